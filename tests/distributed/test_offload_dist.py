"""Offloaded blocks (the "offload" mode) mixed with recomputed and kept ones under DDP, FSDP2 and FSDP on 2
gloo ranks: loss and gradients equal a single-process model without checkpointing on the same global
batch, and each rank moves exactly the bytes a single process moves on its half of the batch: neither
FSDP2's unsharded parameters nor FSDP's flat-parameter views (the weights a linear layer saves) are
copied to the host. The host store is tests/offload_store.py's (numpy memory), so on the CPU the
tensors really leave and come back."""

from __future__ import annotations

import pytest
import torch
from models import GPT, GPTConfig, batch

import distckpt
from distckpt.select.policies import Placement
from tests.offload_store import use_numpy_store
from tests.patterns import full_grads

CFG = GPTConfig(vocab=64, seq=16, dim=32, heads=2, layers=4)
MODES = ("offload", "full", "none", "offload")


def _step(rank: int, world_size: int, strategy: str):
    torch.manual_seed(0)
    model = GPT(CFG)
    distckpt.wrap(model, Placement(MODES))
    pm = distckpt.parallelize(model, strategy)
    idx, tgt = batch(CFG, 4, seed=0)
    with use_numpy_store() as store:
        loss = pm(idx[rank::world_size], tgt[rank::world_size])
        loss.backward()
    return (
        distckpt.checkpointed(pm, modes=True),
        loss.detach(),
        full_grads(pm, strategy),
        (store.packs, store.unpacks, store.bytes),
    )


def _single_process_moves() -> tuple[int, int, int]:
    torch.manual_seed(0)
    model = distckpt.wrap(GPT(CFG), Placement(MODES))
    idx, tgt = batch(CFG, 4, seed=0)
    with use_numpy_store() as store:
        model(idx[0::2], tgt[0::2]).backward()
    return store.packs, store.unpacks, store.bytes


@pytest.mark.dist
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "fsdp"])
def test_offload_under_data_parallel_equals_no_checkpointing(dist_pool, strategy):
    out = dist_pool.run(_step, strategy, timeout=60)
    torch.manual_seed(0)
    ref = GPT(CFG)
    loss = ref(*batch(CFG, 4, seed=0))
    loss.backward()
    moves = _single_process_moves()
    assert moves[0] > 0 and moves[0] == moves[1]
    torch.testing.assert_close((out[0][1] + out[1][1]) / 2, loss.detach(), rtol=1e-6, atol=1e-7)
    for modes, _, grads, moved in out:
        assert modes == {"h.0": "offload", "h.1": "full", "h.3": "offload"}
        assert moved == moves, (strategy, moved, moves)  # no weight (unsharded or a flat-param view) moved
        for n, p in ref.named_parameters():
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
