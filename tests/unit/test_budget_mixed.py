"""Mixed checkpoint modes per block (issue 10): a placement of none, pointwise, selective and full
blocks is exact against the model without checkpointing, and the budget planner mixes them: on a
model whose blocks are mostly pointwise ops (selective keeps little and recomputes half of full's
FLOPs; pointwise keeps both matmul outputs and recomputes no FLOPs), a budget between all-selective's
and all-full's peaks gets a plan with selective blocks whose MemTracker peak fits it at less recompute
than full, and one between all-pointwise's and no checkpointing's gets pointwise blocks at 0
recompute FLOPs (FLOPs counted in a separate pass). The profile measures only the modes a budget can
use, and a plan counts the RNG state each checkpointed block saves (the CPU allocator sees it)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
from models import GPT, GPTConfig, batch
from peaks import allocator_peak
from torch.distributed._tools.mem_tracker import MemTracker

import distckpt
from distckpt import Budget, ConfigError
from distckpt.select.blocks import find_blocks
from distckpt.select.budget import plan_budget, predicted_peak
from distckpt.select.policies import Placement
from distckpt.select.profile import flop_counter, profile_model

CPU = torch.device("cpu")
MIXED = ("none", "selective", "full", "pointwise")


def test_mixed_placement_is_exact_and_reported():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq=16, dim=32, heads=2, layers=4, dropout=0.1)  # dropout: the RNG replays too
    ref = GPT(cfg)
    model = distckpt.wrap(copy.deepcopy(ref), Placement(MIXED))
    assert distckpt.checkpointed(model, modes=True) == {"h.1": "selective", "h.2": "full", "h.3": "pointwise"}
    assert distckpt.checkpointed(model) == ["h.1", "h.2", "h.3"]
    sel, full, pw = (model.h[i]._distckpt_options.context_fn for i in (1, 2, 3))
    assert full is None and sel is not None and pw is not None and sel is not pw
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
    # A Selective policy keeping every matmul output with the default ops is the pointwise mode; other ops: selective.
    pw = distckpt.wrap(copy.deepcopy(ref), distckpt.Selective(every_other_matmul=False))
    assert set(distckpt.checkpointed(pw, modes=True).values()) == {"pointwise"}
    own = distckpt.wrap(copy.deepcopy(ref), distckpt.Selective(save_ops=("mm",), every_other_matmul=False))
    assert set(distckpt.checkpointed(own, modes=True).values()) == {"selective"}


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


class Gated(Pointwise):
    """A pointwise op after fc2 too (its backward needs fc2's output): selective recomputes fc2 (half of
    full's FLOPs), pointwise keeps both matmul outputs and recomputes no FLOPs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = torch.nn.functional.gelu(h) * torch.sigmoid(h)
        return x + torch.nn.functional.gelu(self.fc2(h))


class Stack(nn.Module):
    def __init__(self, d: int = 32, n: int = 4, block: type[nn.Module] = Pointwise):
        super().__init__()
        self.blocks = nn.ModuleList(block(d) for _ in range(n))
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
    with flop_counter() as fc:
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
    model = distckpt.wrap(
        copy.deepcopy(base), Budget(budget, **kw), blocks=_is_block, example_inputs=(x,), reentrant=True
    )
    assert set(distckpt.checkpointed(model, modes=True).values()) == {"full"}
    with pytest.raises(ConfigError, match="'none', 'pointwise', 'selective', 'full'"):
        Placement(("none", "partial"))
    with pytest.raises(ConfigError, match="3 modes for 4 candidate blocks"):
        distckpt.wrap(copy.deepcopy(base), Placement(("full",) * 3), blocks=_is_block)
    for mode in ("selective", "pointwise"):
        with pytest.raises(ConfigError, match=f"{mode} .op-level. checkpointing needs reentrant=False"):
            distckpt.wrap(copy.deepcopy(base), Placement((mode, "none") * 2), blocks=_is_block, reentrant=True)
    no_sel = dataclasses.replace(
        mp, blocks=(dataclasses.replace(mp.blocks[0], selective_held_bytes=-1), *mp.blocks[1:])
    )
    with pytest.raises(ConfigError, match="no selective measurement"):
        predicted_peak(no_sel, ("selective",) * 4, **kw)
    assert "selective" not in plan_budget(no_sel, budget, **kw).modes[:1]  # not offered where not measured
    no_pw = dataclasses.replace(mp, blocks=(dataclasses.replace(mp.blocks[0], pointwise_held_bytes=-1), *mp.blocks[1:]))
    with pytest.raises(ConfigError, match="no pointwise measurement"):
        predicted_peak(no_pw, ("pointwise",) * 4, **kw)


def test_budget_above_all_pointwise_recomputes_no_flops():
    torch.manual_seed(0)
    base, x = Stack(block=Gated), torch.randn(256, 32)
    n = len(base.blocks)
    mp = profile_model(base, find_blocks(base, _is_block), (x,))
    kw = dict(strategy="none", optimizer="none")
    # Pointwise keeps both matmul outputs (selective: fc1's only) and recomputes no FLOPs, measured.
    assert all(b.pointwise_flops == 0 < b.selective_flops for b in mp.blocks)
    assert all(b.selective_held_bytes < b.pointwise_held_bytes < b.activation_bytes for b in mp.blocks)
    pw_peak, none_peak = predicted_peak(mp, ("pointwise",) * n, **kw), predicted_peak(mp, [], **kw)
    assert pw_peak < none_peak
    budget = (pw_peak + none_peak) // 2
    plan = plan_budget(mp, budget, **kw)
    assert plan.recompute_flops == 0 and 0 < plan.modes.count("pointwise") < n, plan
    # At equal FLOPs the fewest blocks are checkpointed: a budget no checkpointing fits keeps every block.
    assert plan_budget(mp, none_peak, **kw).modes == ("none",) * n
    assert plan_budget(mp, budget, selective=False, **kw).recompute_flops > 0  # none/full only: it recomputes
    peak_none, no_recompute = _measure(base, x)
    model = distckpt.wrap(copy.deepcopy(base), Budget(budget, **kw), blocks=_is_block, example_inputs=(x,))
    assert list(distckpt.checkpointed(model, modes=True).values()) == [m for m in plan.modes if m != "none"]
    peak, flops = _measure(model, x)
    assert peak <= budget < peak_none and flops == no_recompute, (peak, budget, peak_none, flops, no_recompute)


def test_profile_measures_only_the_modes_a_budget_can_use(monkeypatch):
    import distckpt.select.profile.recompute_passes as prof

    steps = []  # one entry per sample step with every block checkpointed (memory), by its context_fn
    real = prof._checkpointed_peaks
    monkeypatch.setattr(prof, "_checkpointed_peaks", lambda *a, **k: steps.append(a[6:]) or real(*a, **k))
    torch.manual_seed(0)
    base, x = Stack(), torch.randn(64, 32)
    kw = dict(strategy="none", optimizer="none")
    # Reentrant checkpointing and Budget(selective=False) choose none or full: only full's steps run.
    distckpt.wrap(copy.deepcopy(base), Budget(10**9, **kw), blocks=_is_block, example_inputs=(x,), reentrant=True)
    distckpt.wrap(copy.deepcopy(base), Budget(10**9, selective=False, **kw), blocks=_is_block, example_inputs=(x,))
    assert steps == [(), ()]
    steps.clear()
    model = copy.deepcopy(base)
    blocks = find_blocks(model, _is_block)
    few = profile_model(model, blocks, (x,), modes=("full",))
    assert len(steps) == 1 and all(b.pointwise_held_bytes == b.selective_held_bytes == -1 for b in few.blocks)
    every = profile_model(model, blocks, (x,))  # more modes than cached: measured again
    assert len(steps) == 1 + 3 and all(b.pointwise_held_bytes > 0 < b.selective_held_bytes for b in every.blocks)
    assert profile_model(model, blocks, (x,), modes=("full",)) is every  # the larger profile serves fewer modes
    assert len(steps) == 4
    with pytest.raises(ConfigError, match="profile modes must be among"):
        profile_model(model, blocks, (x,), modes=("partial",))


def _allocator_peak(model: nn.Module, x: torch.Tensor) -> int:
    """The CPU allocator's peak of forward+backward (as benchmarks/memory.py measures, tests/peaks.py: it sees the RNG
    state, MemTracker does not)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [*model.parameters(), x]}
    live = sum(storages.values())
    peak = allocator_peak(lambda: model(x).backward(), live)
    model.zero_grad(set_to_none=True)
    return peak


def test_plan_counts_the_rng_state_each_checkpointed_block_saves():
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(64, 32)
    mp = profile_model(model, find_blocks(model, _is_block), (x,))  # the profile wrap finds in the cache
    kw = dict(strategy="none", optimizer="none")
    rng = torch.get_rng_state().numel()
    assert mp.rng_state_bytes == rng > 0
    no_rng = dataclasses.replace(mp, rng_state_bytes=0)
    assert predicted_peak(mp, [], **kw) == predicted_peak(no_rng, [], **kw)
    assert predicted_peak(mp, range(4), **kw) >= predicted_peak(no_rng, range(4), **kw) + rng
    smallest = plan_budget(mp, 10**12, **kw).min_budget_bytes
    distckpt.wrap(model, Budget(smallest, **kw), blocks=_is_block, example_inputs=(x,))
    measured = _allocator_peak(model, x)
    # Within the smallest budget by the allocator's count; without the RNG term the plan would exceed it.
    assert plan_budget(no_rng, 10**12, **kw).min_budget_bytes < measured <= smallest, (measured, smallest)


def test_plan_report_names_the_pointwise_mode():
    from distckpt.cli.plan import PolicyEstimate, _blocks

    modes = ("full", "pointwise", "pointwise", "none", "selective")
    assert _blocks(PolicyEstimate("budget", 0, 0, (0, 1, 2, 4), modes)) == "full 0, selective 4, pointwise 1-2"


def test_plan_counts_no_rng_state_without_preserve_rng_state():
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(64, 32)
    mp = profile_model(model, find_blocks(model, _is_block), (x,))  # the profile wrap finds in the cache
    kw = dict(strategy="none", optimizer="none")
    no_rng = plan_budget(dataclasses.replace(mp, rng_state_bytes=0), 10**12, **kw).min_budget_bytes
    assert no_rng < plan_budget(mp, 10**12, **kw).min_budget_bytes
    with pytest.raises(ConfigError, match="no choice of checkpointed blocks fits"):  # counting the RNG state
        distckpt.wrap(copy.deepcopy(model), Budget(no_rng, **kw), blocks=_is_block, example_inputs=(x,))
    # The checkpoints keep no RNG state: the plan does not count it, and the allocator's peak stays within.
    distckpt.wrap(model, Budget(no_rng, **kw), blocks=_is_block, example_inputs=(x,), preserve_rng_state=False)
    chosen = [b for b in model.blocks if hasattr(b, "_distckpt_options")]
    assert chosen and all(b._distckpt_options.preserve_rng_state is False for b in chosen)
    assert _allocator_peak(model, x) <= no_rng


class Three(Pointwise):
    """fc3's output only feeds the residual add: the recompute (which stops after the last op that saves a
    tensor, the GELU after fc2) never reads it."""

    def __init__(self, d: int):
        super().__init__(d)
        self.fc3 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc2(torch.tanh(self.fc1(x))))
        return x + self.fc3(h)


def test_budget_plan_holds_from_the_first_step_what_the_profile_learned():
    # Pointwise keeps fc1's, fc2's and fc3's outputs; once a recompute has run, fc3's is not kept
    # (selective._Reach). The profile's FLOP step is that first recompute: the plan counts the trimmed
    # bytes, and training, on the same blocks, holds them from its first step (never over on step one).
    torch.manual_seed(0)
    base, x = Stack(block=Three), torch.randn(256, 32)
    n = len(base.blocks)
    kw = dict(strategy="none", optimizer="none")
    untrimmed = distckpt.wrap(copy.deepcopy(base), Placement(("pointwise",) * n), blocks=_is_block)
    first, second = _measure(untrimmed, x)[0], _measure(untrimmed, x)[0]
    assert second < first  # trimmed from the second step on
    probe = copy.deepcopy(base)
    mp = profile_model(probe, find_blocks(probe, _is_block), (x,))
    assert all(b.pointwise_flops == 0 for b in mp.blocks)
    budget = (predicted_peak(mp, ("pointwise",) * n, **kw) + predicted_peak(mp, [], **kw)) // 2
    model = distckpt.wrap(copy.deepcopy(base), Budget(budget, **kw), blocks=_is_block, example_inputs=(x,))
    assert "pointwise" in distckpt.checkpointed(model, modes=True).values()
    steps = [_measure(model, x)[0] for _ in range(2)]
    assert steps[0] == steps[1] <= budget, (steps, budget)
    # The profile measured the trimmed steps: all-pointwise predicted between the trimmed and untrimmed peaks.
    assert second <= predicted_peak(mp, ("pointwise",) * n, **kw) < first


def test_blocks_the_estimator_did_not_trace_hold_the_trimmed_outputs_from_the_first_step(monkeypatch):
    # budget:auto plans on the fake-tensor estimator, which traces blocks 0, 1 and 5 of 6 and copies their
    # numbers to blocks 2-4: those copy what the traced blocks' recomputes read too (selective.share_reach),
    # so every block is trimmed from the first training step (before: blocks 2-4 learned in step one,
    # which held their fc3 outputs: over the plan).
    from distckpt.select.budget import planner as budget_mod

    torch.manual_seed(0)
    base, x = Stack(n=6, block=Three), torch.randn(256, 32)
    kw = dict(strategy="none", optimizer="none")
    probe = copy.deepcopy(base)
    mp = profile_model(probe, find_blocks(probe, _is_block), (x,))
    size = predicted_peak(mp, ("pointwise",) * 6, **kw)  # all pointwise (0 FLOPs) fits exactly
    monkeypatch.setattr(budget_mod, "auto_budget", lambda device: size)
    model = distckpt.wrap(copy.deepcopy(base), Budget(None, **kw), blocks=_is_block, example_inputs=(x,))
    modes = distckpt.checkpointed(model, modes=True)
    assert all(modes.get(f"blocks.{i}") == "pointwise" for i in (2, 3, 4)), modes
    steps = [_measure(model, x)[0] for _ in range(2)]
    assert steps[0] == steps[1] <= size, (steps, size)
