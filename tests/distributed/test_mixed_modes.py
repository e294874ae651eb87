"""A mixed placement (none, pointwise, selective and full blocks) under DDP on 2 gloo ranks: loss and gradients
equal a single-process model without checkpointing on the same global batch (issue 10)."""

from __future__ import annotations

import pytest
import torch
from models import GPT, GPTConfig, batch

import distckpt
from distckpt.select.policies import Placement

CFG = GPTConfig(vocab=64, seq=16, dim=32, heads=2, layers=4)
MIXED = ("selective", "none", "full", "pointwise")


def _ddp_step(rank: int, world_size: int):
    torch.manual_seed(0)
    model = GPT(CFG)
    distckpt.wrap(model, Placement(MIXED))
    modes = distckpt.checkpointed(model, modes=True)
    pm = distckpt.parallelize(model, "ddp")
    idx, tgt = batch(CFG, 4, seed=0)
    loss = pm(idx[rank::world_size], tgt[rank::world_size])
    loss.backward()
    return modes, distckpt.checkpointed(pm, modes=True), loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.dist
def test_mixed_placement_under_ddp_equals_no_checkpointing(dist_pool):
    out = dist_pool.run(_ddp_step)
    torch.manual_seed(0)
    ref = GPT(CFG)
    loss = ref(*batch(CFG, 4, seed=0))
    loss.backward()
    expected = {"h.0": "selective", "h.2": "full", "h.3": "pointwise"}
    # The global loss is the mean of the two ranks' means (equal halves); DDP averages the gradients:
    # equal up to the order of float sums (all-reduce vs one batch), hence the tight tolerances.
    torch.testing.assert_close((out[0][2] + out[1][2]) / 2, loss.detach(), rtol=1e-6, atol=1e-7)
    for modes, wrapped, _, grads in out:
        assert modes == expected and wrapped == expected
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
