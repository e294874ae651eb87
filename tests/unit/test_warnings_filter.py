"""pyproject.toml's filterwarnings: a FutureWarning or DeprecationWarning attributed to our own code (distckpt/,
launch/) fails the test, here and on the test pool's ranks; one attributed to a library stays a warning."""

from __future__ import annotations

import warnings

import pytest


def _warn_from(module: str, category: type[Warning]) -> None:
    """A warning attributed to ``module`` (the module whose frame the warning's stack level points to)."""
    code = compile("warnings.warn('planted', category)", f"<{module}>", "exec")
    exec(code, {"__name__": module, "warnings": warnings, "category": category})


@pytest.mark.parametrize("module", ["distckpt", "distckpt.integrations.hf", "launch.run"])
@pytest.mark.parametrize("category", [FutureWarning, DeprecationWarning])
def test_a_deprecation_from_our_code_fails(module, category):
    with pytest.raises(category, match="planted"):
        _warn_from(module, category)


@pytest.mark.parametrize("module", ["transformers.trainer", "distckpt_other", "launcher"])
def test_a_deprecation_from_elsewhere_stays_a_warning(module):
    with pytest.warns(FutureWarning, match="planted"):
        _warn_from(module, FutureWarning)


def _rank_warns(rank, world_size):
    _warn_from("distckpt.planted", FutureWarning)


@pytest.mark.dist
def test_a_deprecation_from_our_code_fails_on_the_pool_ranks(dist_pool):
    from harness import RankError

    with pytest.raises(RankError) as err:
        dist_pool.run(_rank_warns, timeout=60)
    assert all(err.value.errors[r][0] == "FutureWarning" for r in (0, 1)), err.value.errors
