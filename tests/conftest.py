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
    """Two CPU ranks over gloo, started once per session; each test runs functions on them."""
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
