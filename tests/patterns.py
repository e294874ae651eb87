"""Multi-task models and the ways a training step uses them (DESIGN.md's table), for the parallel tests.

A pattern is a local loss ``loss(model, x, step, rank) -> scalar`` run on one rank's shard of the
global batch (with gradient accumulation, ``step`` counts micro-batches). The single-process
reference runs every rank's local loss on its shard in one process and averages them (what DDP's
gradient averaging computes), without checkpointing.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

TASKS = ("a", "b", "c")
D_IN, D = 4, 8


class Block(nn.Module):
    """A residual MLP block (the unit distckpt checkpoints)."""

    def __init__(self, d: int = D, hidden: int = 2 * D):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class LoraLinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update."""

    def __init__(self, d_in: int, d_out: int, r: int = 2):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(r, d_in) * 0.3)
        self.b = nn.Parameter(torch.randn(d_out, r) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.a), self.b)


class LoraBlock(nn.Module):
    def __init__(self, d: int = D):
        super().__init__()
        self.fc1 = LoraLinear(d, 2 * d)
        self.fc2 = LoraLinear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class HeadBlock(nn.Module):
    """Task heads inside one module, so that they run inside a checkpointed function."""

    def __init__(self, d: int = D):
        super().__init__()
        self.heads = nn.ModuleDict({t: nn.Linear(d, 1) for t in TASKS})

    def forward(self, h: torch.Tensor, task: str) -> torch.Tensor:
        return self.heads[task](torch.tanh(h))


class MultiTask(nn.Module):
    """embed -> blocks -> one head per task; ``forward(x, tasks)`` computes only the given heads."""

    def __init__(self, n_blocks: int = 2, d: int = D, lora: bool = False, frozen_embed: bool = False,
                 heads_inside: bool = False, loss_param: bool = False):
        super().__init__()
        if loss_param:
            self.log_scale = nn.Parameter(torch.tensor(0.1))  # read by the loss only, never by forward
        self.embed = nn.Linear(D_IN, d)
        self.blocks = nn.ModuleList([(LoraBlock if lora else Block)(d) for _ in range(n_blocks)])
        self.heads_inside = heads_inside
        if heads_inside:
            self.head_block = HeadBlock(d)
        else:
            self.heads = nn.ModuleDict({t: nn.Linear(d, 1) for t in TASKS})
        if frozen_embed or lora:
            self.embed.requires_grad_(False)
        if lora and not heads_inside:
            self.heads.requires_grad_(False)

    def forward(self, x: torch.Tensor, tasks: tuple[str, ...] = TASKS) -> dict[str, torch.Tensor]:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        if self.heads_inside:
            return {t: self.head_block(h, t) for t in tasks}
        return {t: self.heads[t](h) for t in tasks}


def _mse(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (out.squeeze(-1) - x.sum(-1)).pow(2).mean()


def _sampled(step: int, rank: int) -> str:
    # Task sampled per step and rank; head "c" is used by no rank on step 0 and by one rank on step 1.
    return [["a", "b"], ["c", "a"], ["b", "b"], ["a", "c"]][step % 4][rank % 2]


# --- local losses: (model, x, step, rank) -> scalar ----------------------------------------------

def all_heads(model, x, step, rank):
    out = model(x)
    return sum(_mse(out[t], x) for t in TASKS)


def two_forwards(model, x, step, rank):
    half = x.shape[0] // 2
    return _mse(model(x[:half], ("a",))["a"], x[:half]) + _mse(model(x[half:], ("b",))["b"], x[half:])


def unused_output(model, x, step, rank):
    out = model(x)  # head "c" is computed but not in the loss
    return _mse(out["a"], x) + _mse(out["b"], x)


def by_step(model, x, step, rank):
    tasks = [("a",), ("a", "b"), ("c",), ("b", "c")][step % 4]
    out = model(x, tasks)
    return sum(_mse(out[t], x) for t in tasks)


def by_rank(model, x, step, rank):
    t = TASKS[rank % 2]  # rank 0 -> a, rank 1 -> b, c never
    return _mse(model(x, (t,))[t], x)


def sampled(model, x, step, rank):
    t = _sampled(step, rank)
    return _mse(model(x, (t,))[t], x)


def loss_only_param(model, x, step, rank):
    # A parameter used in the loss only, outside the model's forward (a learnable temperature).
    scale = getattr(model, "module", model).log_scale.exp()
    return sampled(model, x, step, rank) * scale


def all_heads_then_zero(model, x, step, rank):
    # Every head is computed; "b" is weighted zero (used: its grad is a real zero, not None), "c" unused.
    out = model(x)
    return _mse(out["a"], x) + 0.0 * _mse(out["b"], x)


@dataclass(frozen=True)
class Pattern:
    name: str
    loss: Callable
    model_kwargs: dict
    micro_batches: int = 1
    static: bool = False  # same used parameters on every step and rank


PATTERNS = {
    p.name: p
    for p in [
        Pattern("all_heads", all_heads, {}, static=True),
        Pattern("two_forwards", two_forwards, {}, static=True),
        Pattern("unused_output", unused_output, {}),
        Pattern("zero_weight", all_heads_then_zero, {}),
        Pattern("by_step", by_step, {}),
        Pattern("by_rank", by_rank, {}),
        Pattern("sampled", sampled, {}),
        Pattern("heads_inside", sampled, {"heads_inside": True}),
        Pattern("lora", all_heads, {"lora": True}, static=True),
        Pattern("lora_two_forwards", two_forwards, {"lora": True}, static=True),
        Pattern("frozen_embed", all_heads, {"frozen_embed": True}, static=True),
        Pattern("loss_only_param", loss_only_param, {"loss_param": True}),
        # Micro-batch m of step s runs as local step 2s+m: heads change between micro-batches, and one
        # head is unused over each whole window (its grad must stay None).
        Pattern("accumulate", by_step, {}, micro_batches=2),
    ]
}


def build(pattern: Pattern, seed: int = 0) -> MultiTask:
    torch.manual_seed(seed)
    return MultiTask(**pattern.model_kwargs)


def batch(step: int, micro: int, global_batch: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + 10 * step + micro)
    return torch.randn(global_batch, D_IN, generator=g)


def shard(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return x.chunk(world_size)[rank]


def make_optimizer(params) -> torch.optim.Optimizer:
    # Weight decay and momentum make a fabricated zero gradient visible in the parameters.
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def reference(pattern: Pattern, world_size: int, steps: int = 3) -> tuple[list[dict], dict]:
    """Single process, no checkpointing: per-step grads (None kept) and final params, by name."""
    model = build(pattern)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad])
    grads = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for micro in range(pattern.micro_batches):
            x = batch(step, micro)
            local_step = step * pattern.micro_batches + micro
            total = sum(pattern.loss(model, shard(x, r, world_size), local_step, r) for r in range(world_size))
            (total / (world_size * pattern.micro_batches)).backward()
        grads.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()
                      if p.requires_grad})
        opt.step()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
