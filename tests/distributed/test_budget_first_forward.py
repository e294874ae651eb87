"""budget without example_inputs: the blocks are chosen on the first training forward, with its inputs,
identically on every rank (DDP), and training matches a single-process model without checkpointing."""

from __future__ import annotations

import copy

import pytest
import torch
from models import GPT, GPTConfig, batch

import distckpt
from distckpt import Budget
from distckpt.select.budget import predicted_peak
from distckpt.select.profile import profile_model

CFG = GPTConfig(vocab=64, seq=16, dim=16, heads=2, layers=4)
STEPS = 2


def _budget(inputs, world_size: int) -> int:
    torch.manual_seed(0)
    model = GPT(CFG)
    mp = profile_model(model, [(f"h.{i}", b) for i, b in enumerate(model.h)], inputs)
    return (
        predicted_peak(mp, range(CFG.layers), world_size=world_size) + predicted_peak(mp, [], world_size=world_size)
    ) // 2


def _local(step: int, rank: int, world_size: int):
    idx, tgt = batch(CFG, 4, seed=step)
    return idx[rank::world_size], tgt[rank::world_size]


def _train(rank: int, world_size: int, budget: int, example: bool):
    torch.manual_seed(0)
    model = GPT(CFG)
    example = _local(0, rank, world_size) if example else None
    distckpt.wrap(model, Budget(budget, strategy="ddp"), example_inputs=example)
    before = distckpt.checkpointed(model)
    pm = distckpt.parallelize(model, "ddp")
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, weight_decay=0.1)
    grads = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        pm(*_local(step, rank, world_size)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return before, distckpt.checkpointed(model, modes=True), grads


def _fsdp_refused(rank: int, world_size: int, strategy: str) -> str:
    model = GPT(CFG)
    distckpt.wrap(model, Budget(10**9))
    try:
        distckpt.parallelize(model, strategy)
    except distckpt.ConfigError as e:
        return str(e)
    return ""


@pytest.mark.dist
def test_ddp_plans_on_first_forward_like_with_example_inputs(dist_pool):
    budget = _budget(_local(0, 0, 2), world_size=2)
    lazy = dist_pool.run(_train, budget, False)
    eager = dist_pool.run(_train, budget, True)
    assert lazy[0][0] == [] and lazy[1][0] == []  # nothing chosen before the first forward
    # The same blocks in the same modes; between full's and no checkpointing's peaks: neither all nor none full.
    chosen = eager[0][1]
    assert lazy[0][1] == lazy[1][1] == chosen and chosen and list(chosen.values()) != ["full"] * CFG.layers, chosen
    torch.manual_seed(0)
    ref = GPT(CFG)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        idx, tgt = batch(CFG, 4, seed=step)
        ref(idx, tgt).backward()  # mean over the global batch == DDP's average of the two halves
        for n, p in ref.named_parameters():
            for r in range(2):
                torch.testing.assert_close(lazy[r][2][step][n], p.grad, rtol=1e-5, atol=1e-6, msg=f"{step} {n}")
        opt.step()


@pytest.mark.dist
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_fsdp_needs_example_inputs(dist_pool, strategy):
    msgs = dist_pool.run(_fsdp_refused, strategy)
    assert all("example_inputs" in m for m in msgs), msgs


def test_single_process_plans_on_first_training_forward():
    torch.manual_seed(0)
    model = GPT(CFG)
    twin = copy.deepcopy(model)
    idx, tgt = batch(CFG, 2, seed=0)
    budget = _budget((idx, tgt), world_size=1)
    distckpt.wrap(model, Budget(budget))
    distckpt.wrap(twin, Budget(budget), example_inputs=(idx, tgt))
    with torch.no_grad():
        model(idx, tgt)  # no grad: says nothing about training memory, no plan yet
    assert distckpt.checkpointed(model) == []
    model(idx, tgt).backward()
    assert distckpt.checkpointed(model) == distckpt.checkpointed(twin) != []
