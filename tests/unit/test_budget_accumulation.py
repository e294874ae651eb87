"""Two places where the budget's prediction was off by a term it counted wrong (issue 10), on HF GPT-2
in one process (the 2-rank FSDP/FSDP2 cases: tests/unit/test_budget_dist.py):

- gradient accumulation: with every gradient already there, a new gradient is a temporary until its
  in-place add into the accumulated one, so the step peaks where the activations and temporaries
  alone peak, not where the sample step (gradients made block by block) paired them with the
  gradients made so far: predicted 1.1% low before (FSDP2, 2 ranks);
- inputs every block takes (HF GPT-2's ``cache_position``): held once however many checkpointed
  blocks keep them; counted once per block, all-``pointwise`` was predicted 7 x 1024 B above its
  measured peak (8 blocks), so a budget sized at that peak did not get it."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from models import SIZES, GPTConfig, batch, hf_gpt2
from peaks import loss_allocator_peak

import distckpt
from distckpt import Budget
from distckpt.apply.wrap import checkpoint_mode
from distckpt.select.budget import plan_budget, predicted_peak
from distckpt.select.policies import Placement
from distckpt.select.profile import memory_tracker, profile_model

pytest.importorskip("transformers")

CPU = torch.device("cpu")


def _gpt2(cfg: GPTConfig) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    idx, _ = batch(cfg, 2)
    return hf_gpt2(cfg).train(), {"input_ids": idx, "labels": idx}


def _blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(f"transformer.h.{i}", b) for i, b in enumerate(model.transformer.h)]


def _accumulating_peak(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> int:
    """MemTracker's peak of a second micro-batch's forward+backward (every gradient exists already)."""
    model(**inputs).loss.backward()
    tracker = memory_tracker(model, *inputs.values())
    with tracker:
        model(**inputs).loss.backward()
    model.zero_grad(set_to_none=True)
    return tracker.get_tracker_snapshot("peak")[CPU]["Total"]


def test_accumulating_step_peaks_at_the_activations_own_peak():
    cfg = GPTConfig(vocab=128, seq=32, dim=64, heads=2, layers=2)
    base, inputs = _gpt2(cfg)
    # MemTracker sees neither the RNG state a checkpoint saves nor the wrapped numbers (24 B per block).
    mp = dataclasses.replace(profile_model(base, _blocks(base), inputs, modes=("full",)), rng_state_bytes=0)
    n = len(mp.blocks)
    kw = dict(strategy="none", optimizer="none", grad_accumulation=True)
    for modes in (("none",) * n, ("full",) * n, ("none", "full")):
        measured = _accumulating_peak(distckpt.wrap(copy.deepcopy(base), Placement(modes)), inputs)
        predicted = predicted_peak(mp, modes, **kw)
        # Within 0.02% (the mixed placement: the checkpointed block's recompute peak measured with every
        # block checkpointed, 304 B high here); never under.
        assert measured <= predicted <= 1.001 * measured, (modes, predicted - measured)
    # Without the activations' own peak (the sample step's pairing with the gradients made so far), the
    # kept blocks are predicted low: the block's MLP output projection's new gradient was missing.
    paired = dataclasses.replace(
        mp, blocks=tuple(dataclasses.replace(b, accumulating_overhead_bytes=-1) for b in mp.blocks)
    )
    measured = _accumulating_peak(distckpt.wrap(copy.deepcopy(base), Placement(("none",) * n)), inputs)
    assert predicted_peak(paired, ("none",) * n, **kw) < measured


def test_budget_at_the_all_pointwise_peak_gets_a_plan_without_recompute_flops():
    base, inputs = _gpt2(SIZES["tiny"])  # 4 blocks, each taking the same cache_position (512 B)
    mp = profile_model(base, _blocks(base), inputs)
    n = len(mp.blocks)
    assert [b.shared_input_bytes for b in mp.blocks] == [0] + [64 * 8] * (n - 1)
    kw = dict(strategy="none", optimizer="none")
    pointwise = ("pointwise",) * n
    measured = loss_allocator_peak(distckpt.wrap(copy.deepcopy(base), Placement(pointwise)), inputs)
    # The CPU allocator sees the RNG states and wrapped numbers the prediction counts: exact.
    assert predicted_peak(mp, pointwise, **kw) == measured
    plan = plan_budget(mp, measured, **kw)
    assert plan.recompute_flops == 0 and plan.peak_bytes <= measured, plan
    model = distckpt.wrap(copy.deepcopy(base), Budget(measured, **kw), example_inputs=inputs)
    modes = tuple(checkpoint_mode(b) for b in model.transformer.h)
    assert modes == plan.modes and loss_allocator_peak(model, inputs) <= measured, modes
    # Counted once per block, the shared input makes the same budget need recompute FLOPs.
    per_block = dataclasses.replace(mp, blocks=tuple(dataclasses.replace(b, shared_input_bytes=0) for b in mp.blocks))
    assert predicted_peak(per_block, pointwise, **kw) == measured + (n - 1) * 64 * 8
    assert plan_budget(per_block, measured, **kw).recompute_flops > 0
