"""budget with strategy="fsdp2" on 2 gloo ranks: each rank's peak memory (MemTracker, AdamW step)
stays under the budget, and gradients equal a single-process model without checkpointing."""

from __future__ import annotations

import pytest
import torch
from models import GPT, GPTConfig, batch

import distckpt
from distckpt import Budget
from distckpt.select.budget import predicted_peak
from distckpt.select.profile import profile_model

CFG = GPTConfig(vocab=64, seq=32, dim=32, heads=2, layers=4)


def _rank_step(rank: int, world_size: int):
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(CFG)
    idx, tgt = batch(CFG, 4, seed=0)
    local = (idx[rank::world_size], tgt[rank::world_size])
    mp = profile_model(model, [(f"h.{i}", b) for i, b in enumerate(model.h)], local)
    kw = dict(strategy="fsdp2", world_size=world_size)
    budget = (predicted_peak(mp, range(CFG.layers), **kw) + predicted_peak(mp, [], **kw)) // 2
    distckpt.wrap(model, Budget(budget, strategy="fsdp2"), example_inputs=local)
    chosen = distckpt.checkpointed(model, modes=True)  # {fqn: mode}
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(*local).backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    opt.step()
    opt.zero_grad(set_to_none=True)
    mt = MemTracker()
    mt.track_external(model, opt, *local)
    with mt:
        model(*local).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return chosen, grads, peak, budget


@pytest.mark.dist
def test_fsdp2_budget_respected_and_exact(dist_pool):
    torch.manual_seed(0)
    ref = GPT(CFG)
    idx, tgt = batch(CFG, 4, seed=0)
    results = dist_pool.run(_rank_step)
    (c0, g0, peak0, budget), (c1, _, peak1, _) = results
    # The same blocks in the same modes on both ranks; a midpoint budget: neither none nor all full.
    assert c0 == c1 and c0 and list(c0.values()) != ["full"] * CFG.layers, c0
    assert peak0 <= budget and peak1 <= budget
    ref(idx, tgt).backward()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(g0[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
