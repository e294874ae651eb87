"""A budget's checkpointed sample step that fails is an error or a warning a user sees (issue 34): before, it was an
INFO line ("any failure only loses precision") followed by a plan that checkpointed blocks whose recompute was
wrong (an MoE without routing replay)."""

from __future__ import annotations

import logging

import moe_sim as sim
import pytest
import torch
import torch.nn as nn

import distckpt
from distckpt import Budget, ConfigError
from distckpt.select.profile import recompute_passes


class _Narrowing(nn.Module):
    """Reads how many features to use from a counter of its calls: the recompute saves tensors of another shape
    (torch's CheckpointError)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        k = 8 + 4 * (self.calls % 2)
        return x + nn.functional.pad(torch.relu(self.fc(x)[:, :k]), (0, 16 - k))


def _budget(model: nn.Module, x: torch.Tensor) -> None:
    distckpt.wrap(model, Budget(1 << 20, strategy="none", optimizer="none"), blocks=[_Narrowing], example_inputs=(x,))


def test_a_recompute_that_differs_from_its_forward_is_an_error():
    model = nn.Sequential(_Narrowing(), _Narrowing())
    with pytest.raises(ConfigError, match="verify_recompute") as e:
        _budget(model, torch.randn(64, 16))
    assert "differs from its forward" in str(e.value) and "blocks=" in str(e.value)


def test_any_other_failure_is_a_warning_and_a_log_line(monkeypatch, caplog):
    def broken(out):
        raise RuntimeError("no loss here")

    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2)))
    real = recompute_passes.scalar_loss
    monkeypatch.setattr(recompute_passes, "scalar_loss", broken)  # the checkpointed steps only
    caplog.set_level(logging.INFO, "distckpt")
    with pytest.warns(RuntimeWarning, match="checkpointed sample step failed .RuntimeError: no loss here"):
        distckpt.wrap(
            model,
            Budget(1 << 20, strategy="none", optimizer="none"),
            blocks=["0", "1"],
            example_inputs=(torch.randn(8, 16),),
        )
    assert real is not broken
    said = [r for r in caplog.records if "sample step failed" in r.getMessage()]
    assert said and all(r.levelno == logging.WARNING for r in said)


def test_an_moe_budget_plans_on_a_step_that_replays_its_routing(caplog):
    """The issue's case: with the perturbation, the sample step of an expert loop raised CheckpointError (logged at
    INFO); with routing replay it runs, and nothing about it is said."""
    caplog.set_level(logging.INFO, "distckpt")
    model = sim.build("handmade", noise="generator")
    b = sim.batch("handmade", tokens=128)
    distckpt.wrap(model, Budget(1 << 20, strategy="none", optimizer="none"), example_inputs=b)
    assert not [r for r in caplog.records if "failed" in r.getMessage()]
    fresh = sim.build("handmade", noise="generator")  # a profile is cached per model: a new one steps again
    with distckpt.routing_replay_disabled(fresh), pytest.raises(ConfigError, match="differs from its forward"):
        distckpt.wrap(fresh, Budget(1 << 20, strategy="none", optimizer="none"), example_inputs=b)
