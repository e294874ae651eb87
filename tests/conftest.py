"""Shared fixtures: the 2-rank gloo pool, seeding, and the `cuda` and `slow` markers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import DistPool  # tests/ is on the path: pyproject's pythonpath
from xdist_order import file_scope, scheduler


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


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, which plain runs need not have
def pytest_xdist_make_scheduler(config, log):
    """`make test`'s ``-n 2 --dist loadgroup``: the tests of a file that defines a module-scoped fixture (a
    reference run, the 4-rank pool, the zoo's report) go to one worker, so it is built once; every other
    test goes to whichever worker is free; the heaviest first (tests/xdist_order.py). xdist's own loadgroup
    groups by ``xdist_group`` marks, which it sees by rewriting ``item._nodeid``: pytest 9 no longer reads
    that (measured: pytest 9.2, xdist 3.8, a marked group spread over both workers), so the groups are made
    here, from the file."""
    if config.getvalue("dist") != "loadgroup":
        return None
    return scheduler(config, log, file_scope(Path(config.rootpath)), _weights(config))


_DURATIONS = "distckpt/durations"  # pytest's cache key: the last run's seconds per test


def _weights(config) -> dict[str, float]:
    """Seconds per test: tests/durations.txt, overridden by the last run's own (pytest's cache)."""
    weights: dict[str, float] = {}
    for line in Path(__file__).with_name("durations.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            seconds, nodeid = line.split(maxsplit=1)
            weights[nodeid] = float(seconds)
    if getattr(config, "cache", None) is not None:  # absent under -p no:cacheprovider
        weights.update(config.cache.get(_DURATIONS, {}))
    return weights


_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if report.when in ("setup", "call"):
        _SECONDS[report.nodeid] = _SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    # The controller of an xdist run (and a plain run) sees every test's report: keep their seconds for the
    # next run's order. A partial run (-k, one file) updates only the tests it ran.
    if getattr(session.config, "cache", None) is not None and _SECONDS and not hasattr(session.config, "workerinput"):
        kept = session.config.cache.get(_DURATIONS, {})
        kept.update({k: round(v, 2) for k, v in _SECONDS.items()})
        session.config.cache.set(_DURATIONS, kept)
