"""A budget given as a spec string is planned for the strategy parallelize uses (issue 10): on 2 gloo
ranks, "budget:SIZE" then parallelize(model, "fsdp2") plans FSDP2 memory (fewer blocks checkpointed
than DDP at the same size, the same blocks as Budget(strategy="fsdp2")), gradients equal a
single-process model without checkpointing, the plan redone is said in the log (with every warning
ignored), and an explicit strategy that parallelize contradicts is refused."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from models import GPT, GPTConfig, batch

import distckpt
from distckpt import Budget
from distckpt.select.budget import predicted_peak
from distckpt.select.profile import profile_model

CFG = GPTConfig(vocab=64, seq=16, dim=32, heads=2, layers=4)


def _local(rank: int, world_size: int):
    idx, tgt = batch(CFG, 4, seed=0)
    return idx[rank::world_size], tgt[rank::world_size]


def _ddp_midpoint(rank: int, world_size: int) -> int:
    torch.manual_seed(0)
    model = GPT(CFG)
    mp = profile_model(model, [(f"h.{i}", b) for i, b in enumerate(model.h)], _local(rank, world_size))
    kw = dict(strategy="ddp", world_size=world_size)
    return (predicted_peak(mp, range(CFG.layers), **kw) + predicted_peak(mp, [], **kw)) // 2


class _Said(logging.Handler):
    """What distckpt told the user on its logger (rank 0's log under the launcher)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _plan(rank: int, world_size: int, policy, strategy: str):
    torch.manual_seed(0)
    model = GPT(CFG)
    local = _local(rank, world_size)
    distckpt.wrap(model, policy, example_inputs=local)
    at_wrap = distckpt.checkpointed(model)
    said, log = _Said(), logging.getLogger("distckpt")
    log.addHandler(said)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PYTHONWARNINGS=ignore: a plan redone is still said
            pm = distckpt.parallelize(model, strategy)
    finally:
        log.removeHandler(said)
    chosen = distckpt.checkpointed(model)
    pm(*local).backward()
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad
        grads[n] = g.full_tensor() if hasattr(g, "full_tensor") else g.clone()
    return at_wrap, chosen, grads, [m for m in said.messages if "redone" in m]


def _refused(rank: int, world_size: int, budget: int) -> str:
    model = GPT(CFG)
    distckpt.wrap(model, Budget(budget, strategy="ddp"), example_inputs=_local(rank, world_size))
    try:
        distckpt.parallelize(model, "fsdp2")
    except distckpt.ConfigError as e:
        return str(e)
    return ""


@pytest.mark.dist
def test_spec_string_budget_follows_parallelize(dist_pool):
    budget = dist_pool.run(_ddp_midpoint)[0]
    spec = f"budget:{budget}"
    ddp = dist_pool.run(_plan, spec, "ddp")
    fsdp2 = dist_pool.run(_plan, spec, "fsdp2")
    direct = dist_pool.run(_plan, Budget(budget, strategy="fsdp2"), "fsdp2")
    for r in range(2):
        assert ddp[r][0] == ddp[r][1]  # planned for DDP over 2 ranks at wrap already: kept
        assert fsdp2[r][0] == ddp[r][0]  # the same plan at wrap, then redone at parallelize
        assert fsdp2[r][1] == direct[r][1]  # ... for FSDP2, exactly as if the strategy had been given
        assert ddp[r][3] == direct[r][3] == []
        assert fsdp2[r][3] == [  # the plan changed: said, whatever the warnings filters
            "distckpt budget: planned for ddp over 2 ranks at wrap, redone for fsdp2 over 2 ranks (parallelize's "
            "layout): the blocks checkpointed may change"
        ]
    assert len(ddp[0][1]) > 0 and len(fsdp2[0][1]) < len(ddp[0][1])  # sharded state leaves room
    assert ddp[0][1] == ddp[1][1] and fsdp2[0][1] == fsdp2[1][1]
    torch.manual_seed(0)
    ref = GPT(CFG)
    ref(*batch(CFG, 4, seed=0)).backward()
    for n, p in ref.named_parameters():
        for run in (ddp, fsdp2):
            for r in range(2):
                torch.testing.assert_close(run[r][2][n], p.grad, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.dist
def test_explicit_strategy_contradicted_by_parallelize_is_refused(dist_pool):
    msgs = dist_pool.run(_refused, 10**9)
    assert all("strategy='fsdp2' to Budget" in m for m in msgs), msgs
