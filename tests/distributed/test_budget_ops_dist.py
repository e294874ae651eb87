"""A budget's per-op choice (the ``"ops"`` mode: which matmul/attention outputs a block keeps, issue 35) under
DDP on 2 gloo ranks: every rank profiles the same op calls (``BlockProfile.recompute_ops``, agreed across the
ranks), plans the same blocks keeping the same calls, and the step's loss and gradients equal a single-process
model without checkpointing on the same global batch."""

from __future__ import annotations

import pytest
import torch
from models import GPT, GPTConfig, batch

import distckpt
from distckpt import Budget
from distckpt.runtime.selective import kept_calls
from distckpt.select.budget import predicted_peak
from distckpt.select.profile import profile_model

CFG = GPTConfig(vocab=64, seq=128, dim=64, heads=2, layers=4)


def _local(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx, tgt = batch(CFG, 2, seed=0)
    return idx[rank::world_size], tgt[rank::world_size]


def _ops_step(rank: int, world_size: int):
    torch.manual_seed(0)
    model = GPT(CFG)
    local = _local(rank, world_size)
    probe = GPT(CFG)  # its profile (agreed between the ranks) sizes the budget: full's predicted DDP peak
    mp = profile_model(probe, [(f"h.{i}", b) for i, b in enumerate(probe.h)], local)
    budget = predicted_peak(mp, range(CFG.layers), strategy="ddp", world_size=world_size)
    distckpt.wrap(model, Budget(budget), example_inputs=local)
    kept = {
        n: kept_calls(b._distckpt_options.context_fn)
        for n, b in model.h.named_children()
        if hasattr(b, "_distckpt_options")
    }
    pm = distckpt.parallelize(model, "ddp")
    loss = pm(*local)
    loss.backward()
    ops = [b.recompute_ops for b in mp.blocks]
    return (
        distckpt.checkpointed(pm, modes=True),
        kept,
        ops,
        loss.detach(),
        {n: p.grad for n, p in model.named_parameters()},
    )


@pytest.mark.dist
def test_per_op_budget_under_ddp_equals_no_checkpointing(dist_pool):
    out = dist_pool.run(_ops_step)
    (modes0, kept0, ops0, *_), (modes1, kept1, ops1, *_) = out
    assert modes0 == modes1 and kept0 == kept1 and ops0 == ops1  # one plan, from one agreed profile
    assert "ops" in modes0.values(), modes0  # the per-op choice is made at this size
    assert all(k is None or k.calls for k in kept0.values())
    torch.manual_seed(0)
    ref = GPT(CFG)
    loss = ref(*batch(CFG, 2, seed=0))
    loss.backward()
    # The global loss is the mean of the two ranks' means (equal halves); DDP averages the gradients: equal up
    # to the order of float sums (all-reduce vs one batch).
    torch.testing.assert_close((out[0][3] + out[1][3]) / 2, loss.detach(), rtol=1e-6, atol=1e-7)
    for *_, grads in out:
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
