"""wrap -> parallelize hand-over: one documented WrapState on the model, and the PlannedPolicy protocol that
Budget implements and a user's policy can implement too (planned at wrap for what it assumes, again for
what parallelize hands over, or on the first training forward without a sample batch)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import distckpt
from distckpt.apply.state import WRAP_STATE, pending_plan, wrap_state
from distckpt.apply.wrap import hand_over
from distckpt.errors import ConfigError
from distckpt.layout import Layout
from distckpt.select import Budget, Candidates, Parallelism, is_planned


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class Stack(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


@dataclasses.dataclass(frozen=True)
class OnePerRank:
    """A user's placement-aware policy: checkpoint as many blocks as there are ranks (not a Budget)."""

    parallelism: Parallelism | None = None
    refuse: str | None = None  # a strategy it contradicts

    def plans_for(self, known: Parallelism) -> Parallelism:
        if known.strategy is None:
            return Parallelism("assumed", known.world_size)
        if known.strategy == self.refuse:
            raise ConfigError(f"OnePerRank cannot plan for {known.strategy}.")
        return known

    def placed(self, parallelism: Parallelism) -> OnePerRank:
        return dataclasses.replace(self, parallelism=parallelism)

    def select(self, candidates: Candidates) -> list[int]:
        return list(range(min(candidates.world_size, len(candidates.blocks))))


def _distckpt_attributes(model: nn.Module) -> list[str]:
    return [k for k in model.__dict__ if k.startswith("_distckpt")]


def test_a_user_policy_is_planned_and_replanned_through_the_protocol():
    assert is_planned(OnePerRank()) and is_planned(Budget(2**30)) and not is_planned(distckpt.Full())
    model = distckpt.wrap(Stack(), OnePerRank(), example_inputs=(torch.randn(2, 8),))
    state = wrap_state(model)
    assert state is not None and state.planned_for == Parallelism("assumed", 1) and state.handed_over is None
    assert distckpt.checkpointed(model) == ["blocks.0"]
    hand_over(model, Layout.of("ddp", world_size=3))  # what parallelize says: planned again for it
    assert distckpt.checkpointed(model) == ["blocks.0", "blocks.1", "blocks.2"]
    assert state.planned_for == state.handed_over == Parallelism("ddp", 3)
    with pytest.raises(ConfigError, match="cannot plan for fsdp"):
        hand_over(
            distckpt.wrap(Stack(), OnePerRank(refuse="fsdp"), example_inputs=(torch.randn(2, 8),)),
            Layout.of("fsdp", world_size=2),
        )


def test_without_a_sample_batch_the_plan_waits_for_the_first_training_forward():
    model = distckpt.wrap(Stack(), OnePerRank())
    state = wrap_state(model)
    assert pending_plan(model) and state.planned_for is None and distckpt.checkpointed(model) == []
    hand_over(model, Layout.of("ddp", world_size=2))  # before the first forward: remembered, not planned yet
    assert pending_plan(model) and distckpt.checkpointed(model) == []
    with torch.no_grad():
        model(torch.randn(2, 8))  # not a training forward: still waiting
    assert pending_plan(model)
    model(torch.randn(2, 8)).backward()
    assert not pending_plan(model) and state.planned_for == Parallelism("ddp", 2)
    assert distckpt.checkpointed(model) == ["blocks.0", "blocks.1"]


def test_wrap_keeps_one_documented_attribute_on_the_model():
    """Measured before: _distckpt_blocks, _distckpt_budget and _distckpt_pending_plan, three hidden attributes."""
    model = distckpt.wrap(Stack(), "budget:1GiB")  # a budget waiting for its first forward
    assert _distckpt_attributes(model) == [WRAP_STATE]
    state = wrap_state(model)
    assert [n for n, _ in state.candidates] == [f"blocks.{i}" for i in range(4)] and state.pending is not None
    distckpt.wrap(model, "full")  # a new call replaces the state and cancels the waiting plan
    assert _distckpt_attributes(model) == [WRAP_STATE] and wrap_state(model) is not state
    assert not pending_plan(model) and wrap_state(model).planned_for is None
    assert distckpt.checkpointed(model) == [f"blocks.{i}" for i in range(4)]
    assert wrap_state(Stack()) is None


def test_a_reentrant_budget_offers_no_op_level_modes():
    """What wrap told the budget by replacing it (selective=False) it now reads from the candidates."""
    torch.manual_seed(0)
    model = distckpt.wrap(Stack(), Budget(10**9), example_inputs=(torch.randn(64, 8),), reentrant=True)
    assert set(distckpt.checkpointed(model, modes=True).values()) <= {"full"}
    assert wrap_state(model).options.reentrant
