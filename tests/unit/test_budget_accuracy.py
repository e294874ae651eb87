"""The budget planner's predicted peak against the MemTracker peak of a real AdamW training step in
steady state (the optimizer state exists), within 3% (issue 10), on a few fast models of the
benchmark (benchmarks/budget_accuracy.py reports every model)."""

from __future__ import annotations

import pytest
import torch
from budget_rows import accuracy_models, measure

MODELS = accuracy_models()


@pytest.mark.parametrize("name", ["MultiTaskGPT", "two-tower (CLIP-like)", "heterogeneous MLP chain", "llama + LoRA"])
def test_predicted_peak_within_three_percent(name):
    make, inputs, blocks = MODELS[name]
    for label, predicted, measured in measure(name, make, inputs(), blocks):
        assert abs(predicted - measured) <= 0.03 * measured, (label, predicted, measured)


def test_llama_never_underestimated():
    # HF Llama's MLP weights are three equal largest parameters in a row: AdamW's per-tensor step holds
    # two temporaries of one and the previous one's denominator (3x, not 2x the largest): with every
    # block checkpointed the step is the peak, and it was predicted 1.08% low.
    make, inputs, blocks = MODELS["llama (HF)"]
    for label, predicted, measured in measure("llama (HF)", make, inputs(), blocks):
        assert measured <= predicted <= 1.03 * measured, (label, predicted, measured)


def test_adam_step_temporaries_match_memtracker():
    import torch

    from distckpt.select.profile import adam_step_temp_bytes, memory_tracker

    params = [torch.nn.Parameter(torch.randn(n)) for n in (100, 4096, 4096, 4096, 64)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params)
    opt.step()  # creates the state
    tracker = memory_tracker(opt, *params)
    with tracker:
        opt.step()
    opt_peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Optstate"]
    states = sum(2 * p.numel() * 4 + 4 for p in params)  # exp_avg, exp_avg_sq and a float32 step each
    assert opt_peak - states == adam_step_temp_bytes(params) == 3 * 4096 * 4


@pytest.mark.parametrize("name", ["MultiTaskGPT", "two-tower (CLIP-like)"])
def test_mixed_placement_predicted_within_three_percent(name):
    # None, pointwise, selective and full blocks in one model (what a budget plan places), in two orders.
    import copy
    import dataclasses

    from peaks import steady_peak

    import distckpt
    from distckpt.select.blocks import find_blocks
    from distckpt.select.budget import predicted_peak
    from distckpt.select.policies import Placement
    from distckpt.select.profile import profile_model

    make, inputs, blocks = MODELS[name]
    torch.manual_seed(0)
    base = make()
    base.train()
    batch = inputs()
    # MemTracker does not see the RNG state checkpointed blocks save (see budget_rows.profiled).
    mp = dataclasses.replace(profile_model(base, find_blocks(base, blocks), batch), rng_state_bytes=0)
    n = len(mp.blocks)
    for order in (("selective", "full", "pointwise", "none"), ("pointwise", "none", "selective", "full")):
        modes = tuple(order[i % 4] for i in range(n))
        model = distckpt.wrap(copy.deepcopy(base), Placement(modes), blocks=blocks)
        predicted, measured = predicted_peak(mp, modes, strategy="none", optimizer="adamw"), steady_peak(model, batch)
        assert abs(predicted - measured) <= 0.03 * measured, (modes, predicted, measured)
