"""Shared fixtures: the 2-rank gloo pool, seeding, and the `cuda` and `slow` markers."""

from __future__ import annotations

import os
import sys

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


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the xdist_group marks set here
def pytest_collection_modifyitems(config, items):
    # `make test` runs two xdist workers with --dist loadgroup: the tests of a file that share a module-scoped
    # fixture (a reference run, the 4-rank pool, the zoo's report) stay on one worker, so it is built once;
    # every other test goes to whichever worker is free.
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d.scope == "module" for fixturedefs in defs for d in fixturedefs):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
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
