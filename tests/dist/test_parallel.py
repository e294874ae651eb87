"""parallelize under DDP, FSDP and FSDP2: every multi-task pattern against the single-process
reference without checkpointing (AdamW with weight decay, 3 steps), or a ConfigError naming the fix."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from harness import RankError
from patterns import PATTERNS, Block, HeadBlock, LoraBlock, batch, build, make_optimizer, reference, shard

import distckpt
from distckpt.wrap import _clean_fqn

STEPS = 3
_BLOCKS = (Block, LoraBlock, HeadBlock)


def _full_grads(pm, strategy):
    if strategy == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(pm, with_grads=True):
            return {_clean_fqn(n): None if p.grad is None else p.grad.detach().clone()
                    for n, p in pm.named_parameters() if p.requires_grad}
    out = {}
    for n, p in pm.named_parameters():
        if not p.requires_grad:
            continue
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[_clean_fqn(n)] = None if g is None else g.detach().clone()
    return out


def _full_params(pm, strategy):
    if strategy == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(pm):
            return {_clean_fqn(n): p.detach().clone() for n, p in pm.named_parameters()}
    return {_clean_fqn(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in pm.named_parameters()}


def _train(rank, world_size, name, strategy, reentrant, graph, steps=STEPS, kwargs=None):
    pattern = PATTERNS[name]
    model = build(pattern)
    distckpt.wrap(model, "full", blocks=lambda m: isinstance(m, _BLOCKS), reentrant=reentrant)
    pm = distckpt.parallelize(model, strategy, graph=graph, **(kwargs or {}))
    opt = make_optimizer([p for p in pm.parameters() if p.requires_grad])
    grads = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for micro in range(pattern.micro_batches):
            x = shard(batch(step, micro), rank, world_size)
            last = micro == pattern.micro_batches - 1
            with contextlib.nullcontext() if last else distckpt.accumulate(pm):
                (pattern.loss(pm, x, step, rank) / pattern.micro_batches).backward()
        grads.append(_full_grads(pm, strategy))
        opt.step()
    return grads, _full_params(pm, strategy)


_REF: dict = {}


def _reference(name):
    if name not in _REF:
        _REF[name] = reference(PATTERNS[name], world_size=2, steps=STEPS)
    return _REF[name]


def _assert_matches(results, name):
    ref_grads, ref_params = _reference(name)
    (g0, p0), (g1, p1) = results
    for step, (rg, a, b) in enumerate(zip(ref_grads, g0, g1)):
        assert a.keys() == rg.keys()
        for n, r in rg.items():
            assert (a[n] is None) == (r is None), f"step {step} {n}: grad None on reference={r is None}"
            assert (b[n] is None) == (r is None), f"step {step} {n}: rank 1 grad None differs"
            if r is not None:
                assert torch.equal(a[n], b[n]), f"step {step} {n}: ranks differ"
                torch.testing.assert_close(a[n], r, rtol=1e-5, atol=1e-6, msg=f"step {step} {n}")
    for n, r in ref_params.items():
        assert torch.equal(p0[n], p1[n]), f"{n}: params differ across ranks"
        torch.testing.assert_close(p0[n], r, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.dist
@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "fsdp"])
def test_pattern_nonreentrant(dist_pool, name, strategy):
    _assert_matches(dist_pool.run(_train, name, strategy, False, "auto", timeout=60), name)
