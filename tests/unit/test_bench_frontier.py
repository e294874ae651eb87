"""The tight end's optimality check (issue 35; benchmarks/frontier.py measures it on HF GPT-2 and Llama): a
block's step down is the cheapest-in-bytes choice that recomputes less (tests/budget_rows.py), and from the
budget's plan at full checkpointing's measured peak every single-block step down measures over that peak."""

from __future__ import annotations

import copy

import pytest
import torch
from budget_rows import choices_of, mode_name, step_down
from models import GPT, GPTConfig, batch
from peaks import profiled_peak, train_step

import distckpt
from distckpt.select import KeepOps, Placement
from distckpt.select.blocks import find_blocks
from distckpt.select.budget import plan_budget
from distckpt.select.profile import profile_model

CFG = GPTConfig(vocab=64, seq=64, dim=32, heads=2, layers=3)


@pytest.fixture(scope="module")
def profiled():
    torch.manual_seed(0)
    base = GPT(CFG).train()
    inputs = batch(CFG, 2)
    probe = copy.deepcopy(base)
    return base, inputs, profile_model(probe, find_blocks(probe), inputs)


def _peak(base, mode, inputs) -> int:
    model = distckpt.wrap(copy.deepcopy(base), mode, example_inputs=inputs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, opt, inputs, {})  # the optimizer state exists: a steady step
    return profiled_peak(model, opt, inputs, {})


def test_step_down_is_the_fewest_bytes_that_recompute_less(profiled):
    b = profiled[2].blocks[0]
    options = choices_of(b)
    assert {"none", "full"} <= {m for m, _, _ in options if isinstance(m, str)}
    assert any(isinstance(m, KeepOps) for m, _, _ in options), "the per-op choices are offered"
    for mode, held, flops in options:
        down = step_down(mode, b)
        less = [o for o in options if o[2] < flops]
        if not less:
            assert down is None, mode_name(mode)
            continue
        to, extra = down
        assert extra == min(o[1] for o in less) - held
        assert next(o for o in options if o[0] == to)[2] < flops


def test_every_step_down_from_the_plan_at_full_peak_measures_over_it(profiled):
    base, inputs, mp = profiled
    target = _peak(base, "full", inputs)
    plan = plan_budget(mp, target, strategy="none")
    modes = [plan.mode_of(i) for i in range(len(mp.blocks))]
    assert _peak(base, Placement(tuple(modes)), inputs) <= target
    downs = 0
    for i, b in enumerate(mp.blocks):
        down = step_down(modes[i], b)
        if down is None:
            continue
        downs += 1
        tried = (*modes[:i], down[0], *modes[i + 1 :])
        assert _peak(base, Placement(tried), inputs) > target, f"block {i}: {mode_name(down[0])} fits full's peak"
    assert downs, "some block could recompute less"
