"""Mixed checkpoint modes per block (issue 10): a placement of none, selective and full blocks is
exact against the model without checkpointing, and the budget planner mixes them: on a model whose
blocks are mostly pointwise ops (selective keeps little and recomputes half of full's FLOPs), a
budget between all-selective's and all-full's peaks gets a plan with selective blocks whose MemTracker
peak fits it at less recompute than full (FLOPs counted in a separate pass)."""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for benchmarks.models

import distckpt  # noqa: E402
from benchmarks.models import GPT, GPTConfig, batch  # noqa: E402
from distckpt import Budget, ConfigError  # noqa: E402
from distckpt.select.blocks import find_blocks  # noqa: E402
from distckpt.select.budget import plan_budget, predicted_peak  # noqa: E402
from distckpt.select.policies import Placement  # noqa: E402
from distckpt.select.profile import profile_model  # noqa: E402

CPU = torch.device("cpu")
MIXED = ("none", "selective", "full", "selective")


def test_mixed_placement_is_exact_and_reported():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq=16, dim=32, heads=2, layers=4, dropout=0.1)  # dropout: the RNG replays too
    ref = GPT(cfg)
    model = distckpt.wrap(copy.deepcopy(ref), Placement(MIXED))
    assert distckpt.checkpointed(model, modes=True) == {"h.1": "selective", "h.2": "full", "h.3": "selective"}
    assert distckpt.checkpointed(model) == ["h.1", "h.2", "h.3"]
    assert model.h[1]._distckpt_options.context_fn is not None and model.h[2]._distckpt_options.context_fn is None
    inputs = batch(cfg, 2)
    torch.manual_seed(1)
    ref_loss = ref(*inputs)
    ref_loss.backward()
    torch.manual_seed(1)
    loss = model(*inputs)
    loss.backward()
    # Same ops on the same values in the same order (a recompute replays the forward): bitwise equal.
    assert torch.equal(loss, ref_loss)
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad), n


class Pointwise(nn.Module):
    """A block of mostly pointwise ops: without checkpointing each saves a 4d-wide tensor; selective
    keeps only fc1's output and recomputes the pointwise ops and fc2 (half of full's FLOPs)."""

    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = torch.nn.functional.gelu(h) * torch.sigmoid(h) + torch.tanh(h).square()
        return x + self.fc2(h)


class Stack(nn.Module):
    def __init__(self, d: int = 32, n: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList(Pointwise(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x).square().mean()


def _is_block(m: nn.Module) -> bool:
    return isinstance(m, Pointwise)


def _measure(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """(MemTracker peak of forward+backward, FLOPs of forward+backward), in separate passes."""
    mt = MemTracker()
    mt.track_external(model, x)
    with mt:
        model(x).backward()
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as fc:
        model(x).backward()
    model.zero_grad(set_to_none=True)
    return mt.get_tracker_snapshot("peak")[CPU]["Total"], fc.get_total_flops()


def test_budget_between_selective_and_full_mixes_modes():
    torch.manual_seed(0)
    base, x = Stack(), torch.randn(256, 32)
    n = len(base.blocks)
    mp = profile_model(base, find_blocks(base, _is_block), (x,))
    kw = dict(strategy="none", optimizer="none")
    assert all(0 <= b.selective_flops < b.full_flops for b in mp.blocks)
    sel_peak, full_peak = predicted_peak(mp, ("selective",) * n, **kw), predicted_peak(mp, range(n), **kw)
    assert full_peak < sel_peak < predicted_peak(mp, [], **kw)
    budget = (sel_peak + full_peak) // 2
    plan = plan_budget(mp, budget, **kw)
    assert "selective" in plan.modes and plan.peak_bytes <= budget, plan
    _, no_recompute = _measure(base, x)
    full = distckpt.wrap(copy.deepcopy(base), "full", blocks=_is_block)
    full_flops = _measure(full, x)[1] - no_recompute
    model = distckpt.wrap(copy.deepcopy(base), Budget(budget, **kw), blocks=_is_block, example_inputs=(x,))
    assert list(distckpt.checkpointed(model, modes=True).values()) == [m for m in plan.modes if m != "none"]
    peak, flops = _measure(model, x)
    assert peak <= budget, (peak, budget)
    assert 0 < flops - no_recompute < full_flops
    assert flops - no_recompute == plan.recompute_flops  # the profile counted each block's recompute
    # Without selective the same budget costs more recompute (the frontier gains points).
    assert plan_budget(mp, budget, selective=False, **kw).recompute_flops > plan.recompute_flops


def test_reentrant_budget_and_bad_placements():
    torch.manual_seed(0)
    base, x = Stack(), torch.randn(256, 32)
    mp = profile_model(base, find_blocks(base, _is_block), (x,))
    kw = dict(strategy="none", optimizer="none")
    budget = (predicted_peak(mp, ("selective",) * 4, **kw) + predicted_peak(mp, range(4), **kw)) // 2
    # Reentrant checkpoint takes no op-level policy: the same budget is planned with none and full only.
    model = distckpt.wrap(copy.deepcopy(base), Budget(budget, **kw), blocks=_is_block, example_inputs=(x,),
                          reentrant=True)
    assert set(distckpt.checkpointed(model, modes=True).values()) == {"full"}
    with pytest.raises(ConfigError, match="'none', 'selective' or 'full'"):
        Placement(("none", "partial"))
    with pytest.raises(ConfigError, match="3 modes for 4 candidate blocks"):
        distckpt.wrap(copy.deepcopy(base), Placement(("full",) * 3), blocks=_is_block)
    with pytest.raises(ConfigError, match="needs reentrant=False"):
        distckpt.wrap(copy.deepcopy(base), Placement(("selective",) * 4), blocks=_is_block, reentrant=True)
    no_sel = dataclasses.replace(mp, blocks=(dataclasses.replace(mp.blocks[0], selective_held_bytes=-1),
                                             *mp.blocks[1:]))
    with pytest.raises(ConfigError, match="no selective measurement"):
        predicted_peak(no_sel, ("selective",) * 4, **kw)
    assert "selective" not in plan_budget(no_sel, budget, **kw).modes[:1]  # not offered where not measured
