"""FSDP units that run conditionally: refused at the end of the forward that skips one, whatever their
names (the block finder and parallelize catch the named ones: test_parallel.py); a unit run under
no_grad inside a training forward is not a skip."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from harness import RankError
from patterns import D_IN, Block, D, Expert, batch, full_grads, shard

import distckpt


class Sparse(nn.Module):
    """A mixture-of-experts layer whose names tell nothing (no 'expert', no 'router'/'gate')."""

    def __init__(self, d: int = D, n: int = 4):
        super().__init__()
        self.selector = nn.Linear(d, n)
        self.mlps = nn.ModuleList([Expert(d) for _ in range(n)])

    def forward(self, h):
        idx = self.selector(h).argmax(-1)
        out = torch.zeros_like(h)
        for e, mlp in enumerate(self.mlps):
            rows = (idx == e).nonzero().flatten()
            if rows.numel():
                out = out.index_add(0, rows, mlp(h[rows]))
        return h + out


class SparseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(D_IN, D)
        self.layers = nn.ModuleList([Sparse() for _ in range(2)])

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return h.pow(2).mean()


def _one_step(rank, world_size, model_cls, blocks, strategy):
    """Build (seeded), checkpoint ``blocks``, parallelize, one forward/backward of this rank's shard;
    the full gradients."""
    torch.manual_seed(0)
    model = model_cls()
    distckpt.wrap(model, "full", blocks=blocks)
    pm = distckpt.parallelize(model, strategy)
    pm(shard(batch(0, 0), rank, world_size)).backward()
    return full_grads(pm, strategy)


@pytest.mark.dist
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_anonymous_experts_as_units_raise_before_backward(dist_pool, strategy):
    with pytest.raises(RankError) as e:
        dist_pool.run(_one_step, SparseNet, Expert, strategy, timeout=60)
    assert "ConfigError" in e.value.kinds(), e.value
    msg = e.value.messages()
    assert "did not run in this forward" in msg and "contains the router" in msg, msg


class Teacher(nn.Module):
    """A trunk whose second block also serves, under no_grad, as a fixed target network."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(D_IN, D)
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        h = self.blocks[0](self.embed(x))
        with torch.no_grad():
            target = self.blocks[1](h)  # all-gathers under FSDP too: not a skipped unit
        return (h - target).pow(2).mean()


@pytest.mark.dist
@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_unit_under_no_grad_inside_forward_is_not_a_skip(dist_pool, strategy):
    got = dist_pool.run(_one_step, Teacher, Block, strategy, timeout=60)
    torch.manual_seed(0)
    ref = Teacher()
    for r in range(2):
        (ref(shard(batch(0, 0), r, 2)) / 2).backward()
    for n, p in ref.named_parameters():
        for g in got:
            assert (g[n] is None) == (p.grad is None), n
            if p.grad is not None:
                torch.testing.assert_close(g[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
    assert copy.deepcopy(ref).blocks[1].fc1.weight.grad is None  # the no_grad block really gets none
