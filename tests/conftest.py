"""Shared fixtures: the 2-rank gloo pool, seeding, and the `cuda` and `slow` markers."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/harness.py and tests/models.py

from harness import DistPool  # noqa: E402


@pytest.fixture(scope="session")
def dist_pool():
    """Two CPU ranks over gloo, started once per session (per xdist worker under `make test`'s -n 2); each
    test runs functions on them."""
    pool = DistPool(world_size=2)
    yield pool
    pool.close()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    # `slow` tests run only when -m names the marker (-m slow, -m "slow or not slow"): the default run
    # keeps a representative core of each sweep (each slow test says which case stays, and why).
    if "slow" not in (config.getoption("markexpr") or ""):
        slow = pytest.mark.skip(reason="slow: run with -m 'slow or not slow' (or -m slow)")
        for item in items:
            if item.get_closest_marker("slow"):
                item.add_marker(slow)
    if not torch.cuda.is_available():
        cuda = pytest.mark.skip(reason="needs a CUDA device")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(cuda)


_MODULE_FIXTURE = re.compile(r"""scope=["']module["']""")


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which plain runs need not have
def pytest_xdist_make_scheduler(config, log):
    """`make test`'s ``-n 2 --dist loadgroup``: the tests of a file that defines a module-scoped fixture (a
    reference run, the 4-rank pool, the zoo's report) go to one worker, so it is built once; every other
    test goes to whichever worker is free. xdist's own loadgroup groups by ``xdist_group`` marks, which it
    sees by rewriting ``item._nodeid``: pytest 9 no longer reads that (measured: pytest 9.2, xdist 3.8, a
    marked group spread over both workers), so the groups are made here, from the file."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    shared: dict[str, bool] = {}

    def scope(nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        if path not in shared:
            file = Path(config.rootpath, path)
            shared[path] = file.is_file() and bool(_MODULE_FIXTURE.search(file.read_text()))
        return path if shared[path] else nodeid

    class ByModuleFixture(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope(nodeid)

    return ByModuleFixture(config, log)
