"""The per-op choice inside a block (the ``"ops"`` mode, issue 35): which matmul/attention outputs a checkpointed
block keeps. Measured, not assumed: its recompute FLOPs (FlopCounterMode) and peak (the CPU allocator's, under
torch.profiler) against the plan's prediction, gradients against no checkpointing, and the budget at full
checkpointing's measured peak against the budget without the per-op choice."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch
from models import GPT, GPTConfig, batch
from peaks import allocator_peak

import distckpt
from distckpt import Budget, ConfigError
from distckpt.select import KeepOps, Placement
from distckpt.select.budget import plan_budget, predicted_peak
from distckpt.select.budget.op_sets import keep_sets
from distckpt.select.profile import ModelProfile, flop_counter, profile_model

TINY = GPTConfig(vocab=64, seq=32, dim=32, heads=2, layers=4)
# Attention dominates a block's FLOPs (seq 512 against width 96), and a block's gradients outweigh its input
# (12 * 96 > 512 tokens): at full's peak (the first block's backward, every gradient made) the later blocks have
# room to keep their attention output, which saves most of their recompute.
LONG = GPTConfig(vocab=64, seq=512, dim=96, heads=2, layers=6)


def _blocks(model: GPT) -> list[tuple[str, torch.nn.Module]]:
    return [(f"h.{i}", b) for i, b in enumerate(model.h)]


def _profile(model: GPT, x: tuple[torch.Tensor, ...]) -> ModelProfile:
    """The profile of a copy of ``model`` (the profile is cached per model: ``model`` stays unprofiled)."""
    probe = copy.deepcopy(model)
    return profile_model(probe, _blocks(probe), x)


def _peak(model: GPT, x: tuple[torch.Tensor, ...]) -> int:
    """The CPU allocator's peak of forward+backward, parameters and batch included."""
    live = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [*model.parameters(), *x]}
    peak = allocator_peak(lambda: model(*x).backward(), sum(live.values()))
    model.zero_grad(set_to_none=True)
    return peak


def _step_peak(model: GPT, x: tuple[torch.Tensor, ...]) -> int:
    """The CPU allocator's peak of a steady AdamW step (the first step makes the optimizer state)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        model(*x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    state = [t for s in opt.state.values() for t in s.values()]
    live = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [*model.parameters(), *state, *x]}
    return allocator_peak(step, sum(live.values()))


def _flops(model: GPT, x: tuple[torch.Tensor, ...]) -> int:
    with flop_counter() as fc:
        model(*x).backward()
    model.zero_grad(set_to_none=True)
    return fc.get_total_flops()


def test_keep_sets_are_the_pareto_front_of_every_subset():
    ops = (("a", 0, 6, 8), ("b", 0, 2, 5), ("a", 1, 2, 2), ("c", 0, 8, 10), ("d", 0, 4, 0))
    front = keep_sets(ops)
    everything = [
        (sum(o[2] for o in s), sum(o[3] for o in s), s) for k in range(1, 5) for s in itertools.combinations(ops[:4], k)
    ]
    for nbytes, saved, _ in everything:  # nothing beats the front: at most as many bytes never saves more
        assert any(b <= nbytes and f >= saved for _, b, f in front), (nbytes, saved)
    for calls, nbytes, saved in front:  # each point is a real subset with its exact sums; "d" saves nothing
        assert ("d", 0) not in calls
        assert (nbytes, saved) in {(b, f) for b, f, _ in everything}
    assert [b for _, b, _ in front] == sorted({b for _, b, _ in front})
    assert [f for *_, f in front] == sorted({f for *_, f in front})
    many = tuple(("mm", i, 1 + i % 7, 3 + (i * 5) % 11) for i in range(40))
    assert len(keep_sets(many, 16)) <= 17  # merged on a grid, still a front
    merged = keep_sets(many, 16)
    assert all(a[1] < b[1] and a[2] < b[2] for a, b in zip(merged, merged[1:]))


def test_recompute_ops_add_up_to_what_the_recompute_runs():
    torch.manual_seed(0)
    model, x = GPT(TINY), batch(TINY, 2)
    mp = profile_model(model, _blocks(model), x)
    for b in mp.blocks:
        assert b.recompute_ops, b.fqn
        # The FLOP-counting calls the full recompute runs: their FLOPs are its FLOPs, and keeping all of them is
        # pointwise's measured hold (the MLP's output projection, after the recompute's early stop, is not listed).
        assert sum(o[3] for o in b.recompute_ops) == b.recompute_flops
        assert b.input_bytes + sum(o[2] for o in b.recompute_ops) == b.pointwise_held_bytes
        assert [o[0].split(".")[1] for o in b.recompute_ops] == [
            "addmm",
            "_scaled_dot_product_flash_attention_for_cpu",
            "addmm",
            "addmm",
        ]


def test_kept_ops_gradients_equal_no_checkpointing_and_flops_as_planned():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, seq=32, dim=32, heads=2, layers=4, dropout=0.1)
    ref, x = GPT(cfg), batch(cfg, 2)
    mp = _profile(ref, x)
    ops = mp.blocks[0].recompute_ops  # dropout: attention runs as bmm + softmax, the MLP's last matmul is reached
    calls = [(o[0], o[1]) for o in ops]
    keep = [KeepOps(tuple(calls[1:3])), KeepOps((calls[0], calls[4])), "none", "full"]
    model = distckpt.wrap(copy.deepcopy(ref), Placement(tuple(keep)))
    assert distckpt.checkpointed(model, modes=True) == {"h.0": "ops", "h.1": "ops", "h.3": "full"}
    torch.manual_seed(1)
    ref(*x).backward()
    torch.manual_seed(1)
    model(*x).backward()
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        assert torch.equal(p.grad, q.grad), n
    model.zero_grad(set_to_none=True)
    kept = {(o[0], o[1]): o[3] for o in ops}
    expected = sum(mp.blocks[i].full_flops - sum(kept[c] for c in k.calls) for i, k in enumerate(keep[:2]))
    expected += mp.blocks[3].full_flops
    base = _flops(copy.deepcopy(ref).eval().train(), x)
    assert _flops(model, x) - base == expected


def test_kept_ops_predicted_within_3_percent_and_never_under():
    # Every block keeping the same subset of its 4 FLOP-counting calls (16), and 12 random mixes of subsets,
    # none and full: the predicted peak of forward+backward is at or above the allocator's and within 3%.
    torch.manual_seed(0)
    model, x = GPT(TINY), batch(TINY, 2)
    mp = _profile(model, x)
    calls = [(o[0], o[1]) for o in mp.blocks[0].recompute_ops]
    subsets = [KeepOps(tuple(s)) for k in range(len(calls) + 1) for s in itertools.combinations(calls, k)]
    rng = random.Random(0)
    placements = [(s,) * TINY.layers for s in subsets]
    placements += [tuple(rng.choice([*subsets, "none", "full"]) for _ in range(TINY.layers)) for _ in range(12)]
    base = _flops(model, x)
    for modes in placements:
        wrapped = distckpt.wrap(copy.deepcopy(model), Placement(modes))
        measured = _peak(wrapped, x)
        predicted = predicted_peak(mp, list(modes), strategy="none", optimizer="none")
        assert measured <= predicted <= 1.03 * measured, (modes, measured, predicted)
        flops = sum(
            0
            if m == "none"
            else b.full_flops - sum(o[3] for o in b.recompute_ops if m != "full" and (o[0], o[1]) in m.calls)
            for b, m in zip(mp.blocks, modes)
        )
        assert _flops(wrapped, x) - base == flops, modes


def test_budget_at_full_peak_keeps_attention_and_recomputes_at_most_0_6_of_full():
    torch.manual_seed(0)
    model, x = GPT(LONG), batch(LONG, 1)
    base = _flops(model, x)
    full = distckpt.wrap(copy.deepcopy(model), "full")
    target = _step_peak(full, x)
    full_recompute = _flops(full, x) - base
    out = {}
    for per_op in (False, True):
        wrapped = distckpt.wrap(copy.deepcopy(model), Budget(target, per_op=per_op), example_inputs=x)
        assert _step_peak(wrapped, x) <= target, per_op  # never over: the allocator's count, a real AdamW step
        out[per_op] = (_flops(wrapped, x) - base, distckpt.checkpointed(wrapped, modes=True))
    mp = _profile(model, x)
    plan = plan_budget(mp, target, strategy="none")
    assert out[True][0] == plan.recompute_flops  # what it runs is what it planned
    assert out[False][0] > 0.6 * full_recompute  # per block, the tight end recomputes most of full's
    assert out[True][0] <= 0.6 * full_recompute, (out[True][0] / full_recompute, out[True][1])
    assert "ops" in out[True][1].values()
    attention = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    assert all(k is None or (attention, 0) in k.calls for k in plan.keep), plan.keep  # the attention output first


def test_kept_ops_refusals():
    torch.manual_seed(0)
    model, x = GPT(TINY), batch(TINY, 2)
    mp = _profile(model, x)
    with pytest.raises(ConfigError, match="does not run as FLOP-counting calls"):
        predicted_peak(mp, [KeepOps((("aten.gelu.default", 0),))] + ["none"] * 3)
    with pytest.raises(ConfigError, match=r"\(op name, call index\) pairs"):
        KeepOps((("aten.addmm.default", -1),))
    with pytest.raises(ConfigError, match="or a KeepOps"):
        Placement(("ops", "none", "none", "none"))
    keep = KeepOps(((mp.blocks[0].recompute_ops[0][0], 0),))
    with pytest.raises(ConfigError, match="needs reentrant=False"):
        distckpt.wrap(copy.deepcopy(model), Placement((keep, "none", "none", "none")), reentrant=True)
    # A budget whose profile has no op-level modes (reentrant) makes no per-op choice either.
    wrapped = distckpt.wrap(
        copy.deepcopy(model), Budget(predicted_peak(mp, range(4))), reentrant=True, example_inputs=x
    )
    assert set(distckpt.checkpointed(wrapped, modes=True).values()) <= {"full"}
