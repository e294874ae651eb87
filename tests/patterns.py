"""Multi-task models and the ways a training step uses them (DESIGN.md's table and issue 9's bug
reports), for the parallel tests.

A pattern is a local loss ``loss(model, x, step, rank) -> scalar`` run on one rank's shard of the
global batch (with gradient accumulation, ``step`` counts micro-batches), and a *schedule*: the order
of the forwards and backwards of one optimizer step (one after the other, or all forwards first).
The single-process reference runs every rank's schedule on its shard in one process and averages
(what DDP's gradient averaging computes), without checkpointing. ``full_grads``/``full_params``
gather what a parallel model holds, ``assert_matches`` compares it with the reference.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distckpt.runtime.swap import _clean_fqn

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

    def __init__(
        self,
        n_blocks: int = 2,
        d: int = D,
        lora: bool = False,
        frozen_embed: bool = False,
        heads_inside: bool = False,
        loss_param: bool = False,
        frozen_copy: bool = False,
    ):
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
        if frozen_copy:
            # A DPO reference model: a frozen copy of the initial weights, outside the module tree (so
            # neither wrap nor parallelize sees it), run under torch.no_grad() by the loss.
            self.__dict__["frozen_ref"] = copy.deepcopy(self).requires_grad_(False)

    def forward(self, x: torch.Tensor, tasks: tuple[str, ...] = TASKS) -> dict[str, torch.Tensor]:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        if self.heads_inside:
            return {t: self.head_block(h, t) for t in tasks}
        return {t: self.heads[t](h) for t in tasks}


class Expert(nn.Module):
    """One expert of a mixture-of-experts layer: executed only when some token is routed to it."""

    def __init__(self, d: int = D):
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(h)))


class MoELayer(nn.Module):
    """A router and its experts, top-1 routing by data: each rank runs the experts its shard chose."""

    def __init__(self, d: int = D, n_experts: int = 4):
        super().__init__()
        self.router = nn.Linear(d, n_experts)
        self.experts = nn.ModuleList([Expert(d) for _ in range(n_experts)])

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.router(h).softmax(-1).max(-1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, idx = self.route(h)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            rows = (idx == e).nonzero().flatten()
            if rows.numel():  # an expert no row chose does not run (as in Mixtral, Qwen2-MoE, OLMoE)
                out = out.index_add(0, rows, expert(h[rows]) * gate[rows, None])
        return h + out


class MoE(nn.Module):
    """embed -> MoE layers -> one head; the experts hold most parameters (the block finder's trap)."""

    def __init__(self, n_layers: int = 2, d: int = D, n_experts: int = 4):
        super().__init__()
        self.embed = nn.Linear(D_IN, d)
        self.layers = nn.ModuleList([MoELayer(d, n_experts) for _ in range(n_layers)])
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return {"a": self.head(h)}

    def experts_used(self, x: torch.Tensor) -> list[set[int]]:
        """Per layer, the experts the rows of ``x`` are routed to (no grad, no side effects)."""
        used = []
        with torch.no_grad():
            h = self.embed(x)
            for layer in self.layers:
                used.append(set(layer.route(h)[1].tolist()))
                h = layer(h)
        return used


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


# --- issue 9: several autograd passes per step, forwards without a backward, DPO ---------------


def first_head(model, x, step, rank):
    return _mse(model(x)["a"], x)


def grad_penalty(model, x, step, rank):
    # A gradient penalty (WGAN-GP, R1): a first backward with create_graph=True inside the loss,
    # then loss.backward() differentiates through it (double backward through the blocks).
    x_in = x.clone().requires_grad_(True)
    out = model(x_in)
    task = sum(_mse(out[t], x) for t in TASKS)
    (g,) = torch.autograd.grad(sum(o.sum() for o in out.values()), x_in, create_graph=True)
    return task + 0.1 * g.pow(2).mean()


def grad_no_write(model, x, step, rank):
    # autograd.grad(inputs=...) writes no .grad: a saliency pass through head "c" only, then the loss
    # (heads "a", "b") is backwarded. Head "c" takes part in a backward, yet its .grad stays None.
    x_in = x.clone().requires_grad_(True)
    out = model(x_in)
    (g,) = torch.autograd.grad(_mse(out["c"], x), x_in, retain_graph=True)
    weight = 1.0 / (1.0 + g.pow(2).sum())  # no create_graph: a constant for the backward below
    return weight * (_mse(out["a"], x) + _mse(out["b"], x))


def grad_params(model, x, step, rank):
    # Meta-learning style: the gradient of an inner loss w.r.t. some parameters (head "c": not in the
    # outer loss), writing no .grad, scales the outer loss. Parameters are read outside forward, so
    # DDP only (FSDP shards them there).
    out = model(x)
    head = getattr(model, "module", model).heads["c"]
    inner = _mse(out["c"], x)
    gw, gb = torch.autograd.grad(inner, [head.weight, head.bias], retain_graph=True)
    weight = 1.0 / (1.0 + gw.pow(2).sum() + gb.pow(2).sum())
    return weight * (_mse(out["a"], x) + _mse(out["b"], x))


def eval_between(model, x, step, rank):
    # Evaluation with grad enabled between the training forward and its backward: its outputs (all
    # heads, "c" included) are never backwarded, so head "c" stays unused (.grad None).
    out = model(x, ("a", "b"))
    _ = model(x.flip(0))
    return _mse(out["a"], x) + _mse(out["b"], x)


def _score(out: dict[str, torch.Tensor]) -> torch.Tensor:
    # Every head in the score: the same parameters every step (static).
    return out["a"].squeeze(-1) - 0.5 * out["b"].squeeze(-1) + 0.25 * out["c"].squeeze(-1)


def dpo(model, x, step, rank):
    # DPO-style: chosen and rejected halves through the same model, one loss on the margin.
    half = x.shape[0] // 2
    chosen, rejected = _score(model(x[:half])), _score(model(x[half:]))
    return -F.logsigmoid(chosen - rejected).mean()


def dpo_frozen_ref(model, x, step, rank):
    # As `dpo`, with the margin taken relative to a frozen reference copy run under no_grad.
    half = x.shape[0] // 2
    ref = getattr(model, "module", model).frozen_ref
    with torch.no_grad():
        ref_margin = _score(ref(x[:half])) - _score(ref(x[half:]))
    chosen, rejected = _score(model(x[:half])), _score(model(x[half:]))
    return -F.logsigmoid(chosen - rejected - ref_margin).mean()


# --- schedules: the forwards and backwards of one optimizer step ---------------------------------
# schedule(model, loss, xs, step, rank, accumulate, scale): xs are the step's micro-batches (this
# rank's shards), `accumulate()` a context that skips gradient sync (distckpt.accumulate(model) on a
# rank, nothing in the reference), `scale` multiplies every loss (1/world_size in the reference).


def _local(loss, model, xs, step, rank, m, scale):
    return loss(model, xs[m], step * len(xs) + m, rank) * (scale / len(xs))


def sequential(model, loss, xs, step, rank, accumulate, scale):
    """Each micro-batch's forward then backward; all but the last inside accumulate (the usual loop)."""
    for m in range(len(xs)):
        with contextlib.nullcontext() if m == len(xs) - 1 else accumulate():
            _local(loss, model, xs, step, rank, m, scale).backward()


def interleaved_sync(model, loss, xs, step, rank, accumulate, scale):
    """All forwards first, then the backwards one by one, each syncing (no accumulate)."""
    losses = [_local(loss, model, xs, step, rank, m, scale) for m in range(len(xs))]
    for lo in losses:
        lo.backward()


def interleaved_109191(model, loss, xs, step, rank, accumulate, scale):
    """pytorch#109191: micro-batch 0's forward outside accumulate, micro-batch 1's forward and backward
    inside, micro-batch 0's backward last (outside: it syncs the whole window)."""
    first = _local(loss, model, xs, step, rank, 0, scale)
    with accumulate():
        _local(loss, model, xs, step, rank, 1, scale).backward()
    first.backward()


def interleaved_accumulate(model, loss, xs, step, rank, accumulate, scale):
    """The forwards of all micro-batches but the last, then their backwards, inside accumulate; the last
    micro-batch's forward and backward outside."""
    with accumulate():
        losses = [_local(loss, model, xs, step, rank, m, scale) for m in range(len(xs) - 1)]
        for lo in losses:
            lo.backward()
    _local(loss, model, xs, step, rank, len(xs) - 1, scale).backward()


def default_blocks(module: nn.Module) -> bool:
    return isinstance(module, (Block, LoraBlock, HeadBlock))


@dataclass(frozen=True)
class Pattern:
    name: str
    loss: Callable
    model_kwargs: dict
    micro_batches: int = 1
    static: bool = False  # same used parameters on every step and rank
    schedule: Callable = sequential
    model: Callable[..., nn.Module] = MultiTask
    blocks: Any = default_blocks  # distckpt.wrap's blocks= (None: let distckpt find them)
    autograd_grad: bool = False  # calls torch.autograd.grad: reentrant checkpointing cannot run it
    data_seed: int = 1000  # of the global batches (see batch())


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
        # issue 9. MoE: ranks route to different experts, some expert is unused on some rank and step;
        # on step 0 the ranks run as many experts per layer but different ones (the data seed is chosen
        # for that; test_parallel checks it). blocks=None must choose the MoE layers, not the experts.
        Pattern("moe", first_head, {}, model=MoE, blocks=None, data_seed=2900),
        Pattern("grad_penalty", grad_penalty, {}, autograd_grad=True),
        Pattern("grad_no_write", grad_no_write, {}, autograd_grad=True),
        Pattern("grad_params", grad_params, {}, autograd_grad=True),
        Pattern("eval_between", eval_between, {}),
        Pattern("dpo", dpo, {}, static=True),
        Pattern("dpo_frozen_ref", dpo_frozen_ref, {"frozen_copy": True}, static=True),
        # Heads sampled by rank and micro-batch, so each backward uses different parameters.
        Pattern("interleaved_sync", sampled, {}, micro_batches=2, schedule=interleaved_sync),
        Pattern("interleaved_109191", sampled, {}, micro_batches=2, schedule=interleaved_109191),
        Pattern("interleaved_accumulate", sampled, {}, micro_batches=3, schedule=interleaved_accumulate),
    ]
}


class Buffered(MultiTask):
    """MultiTask with a constant buffer read in forward (as HF Llama's rotary ``inv_freq``)."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, D_IN))

    def forward(self, x: torch.Tensor, tasks: tuple[str, ...] = TASKS) -> dict[str, torch.Tensor]:
        return super().forward(x * self.scale, tasks)


def rank_forwards(model, x, step, rank):
    """A second task's forward on rank 1 only, on odd steps: the ranks run different numbers of forwards."""
    loss = _mse(model(x, ("a",))["a"], x)
    if rank == 1 and step % 2:
        loss = loss + _mse(model(-x, ("b",))["b"], x)
    return loss


# DDP only, so not in PATTERNS (whose sweeps run FSDP too): a forward that one rank runs alone would all-gather alone
# there. Under DDP it hung in the buffer broadcast DDP runs at every forward (distckpt turns it off: no running stats).
RANK_FORWARDS = Pattern("rank_forwards", rank_forwards, {}, model=Buffered)


def build(pattern: Pattern, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return pattern.model(**pattern.model_kwargs)


def batch(step: int, micro: int, global_batch: int = 8, seed: int = 1000) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 10 * step + micro)
    return torch.randn(global_batch, D_IN, generator=g)


def shard(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return x.chunk(world_size)[rank]


def micro_batches(pattern: Pattern, step: int, rank: int, world_size: int) -> list[torch.Tensor]:
    return [shard(batch(step, m, seed=pattern.data_seed), rank, world_size) for m in range(pattern.micro_batches)]


def make_optimizer(params) -> torch.optim.Optimizer:
    # Weight decay and momentum make a fabricated zero gradient visible in the parameters.
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def train_parallel(pm: nn.Module, pattern: Pattern, strategy: str, rank: int, world_size: int, steps: int = 3) -> tuple:
    """Train the parallel model ``pm`` as :func:`reference` trains the plain one (this rank's shards, the
    pattern's schedule, AdamW): per-step full grads and final full params, for :func:`assert_matches`."""
    import distckpt

    opt = make_optimizer([p for p in pm.parameters() if p.requires_grad])
    grads = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        xs = micro_batches(pattern, step, rank, world_size)
        pattern.schedule(pm, pattern.loss, xs, step, rank, lambda: distckpt.accumulate(pm), 1.0)
        grads.append(full_grads(pm, strategy))
        opt.step()
    return grads, full_params(pm, strategy)


def reference(
    pattern: Pattern, world_size: int, steps: int = 3, *, unused_as_zero: bool = False
) -> tuple[list[dict], dict]:
    """Single process, no checkpointing: per-step grads (None kept) and final params, by name.

    ``unused_as_zero``: a parameter no rank used in a step gets a zero gradient instead of None (DeepSpeed's rule),
    so the optimizer's weight decay and moments still apply to it."""
    model = build(pattern)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad])
    grads = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for r in range(world_size):
            xs = micro_batches(pattern, step, r, world_size)
            pattern.schedule(model, pattern.loss, xs, step, r, contextlib.nullcontext, 1.0 / world_size)
        for p in model.parameters():
            if unused_as_zero and p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        grads.append(
            {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        )
        opt.step()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


@functools.cache
def reference_of(name: str, world_size: int = 2, steps: int = 3) -> tuple[list[dict], dict]:
    """:func:`reference` of ``PATTERNS[name]``, computed once per process: the sweeps compare many runs with it."""
    return reference(PATTERNS[name], world_size=world_size, steps=steps)


def reference_grad_norm(name: str, world_size: int) -> float:
    """The global gradient norm of :func:`reference_of`'s first step: what a guard's report must say."""
    grads = reference_of(name, world_size=world_size, steps=1)[0][0]
    return float(torch.cat([g.flatten() for g in grads.values() if g is not None]).norm())


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


# --- what a parallel model holds, and the comparison with the reference ---------------------------


def full_grads(pm: nn.Module, strategy: str) -> dict[str, torch.Tensor | None]:
    """Each trainable parameter's full gradient (None kept) by clean FQN; collective under FSDP."""
    if strategy == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # What the optimizer sees is each rank's shard of the original params: a grad is None when
        # it is None on every rank holding part of the param; the values come from summon_full_params.
        named = [(n, p) for n, p in pm.named_parameters() if p.requires_grad]
        has = torch.tensor(
            [[p.grad is not None, p.grad is None and p.numel() > 0] for _, p in named], dtype=torch.int32
        )
        dist.all_reduce(has)
        assert not (has[:, 0] > 0).logical_and(has[:, 1] > 0).any(), "grad None on some shards only"
        with FSDP.summon_full_params(pm, with_grads=True):
            got = {_clean_fqn(n): p.grad for n, p in pm.named_parameters()}
            return {
                _clean_fqn(n): None if not has[i, 0] else got[_clean_fqn(n)].detach().clone()
                for i, (n, _) in enumerate(named)
            }
    out = {}
    for n, p in pm.named_parameters():
        if not p.requires_grad:
            continue
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[_clean_fqn(n)] = None if g is None else g.detach().clone()
    return out


def full_params(pm: nn.Module, strategy: str) -> dict[str, torch.Tensor]:
    """Every parameter's full value by clean FQN; collective under FSDP/FSDP2."""
    if strategy == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(pm):
            return {_clean_fqn(n): p.detach().clone() for n, p in pm.named_parameters()}
    return {
        _clean_fqn(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in pm.named_parameters()
    }


def assert_matches(
    results: list, ref: tuple[list[dict], dict], rtol: float = 1e-5, atol: float = 1e-6, param_atol: float | None = None
) -> None:
    """``results``: per rank (2 or more) ``(per-step grads, final params)``; equal across ranks, close to ``ref``
    (params within ``param_atol`` when given, else as the grads)."""
    ref_grads, ref_params = ref
    (g0, p0), others = results[0], results[1:]
    assert all(len(g) == len(g0) == len(ref_grads) for g, _ in others)
    for step, rg in enumerate(ref_grads):
        a = g0[step]
        assert a.keys() == rg.keys()
        for n, r in rg.items():
            assert (a[n] is None) == (r is None), f"step {step} {n}: grad None on reference={r is None}"
            for k, (g, _) in enumerate(others, 1):
                assert (g[step][n] is None) == (r is None), f"step {step} {n}: rank {k} grad None differs"
                if r is not None:
                    assert torch.equal(a[n], g[step][n]), f"step {step} {n}: ranks 0 and {k} differ"
            if r is not None:
                torch.testing.assert_close(
                    a[n], r, rtol=rtol, atol=atol, msg=lambda m, s=step, n=n: f"step {s} {n}: {m}"
                )
    assert p0.keys() == ref_params.keys()
    for n, r in ref_params.items():
        assert all(torch.equal(p0[n], p[n]) for _, p in others), f"{n}: params differ across ranks"
        torch.testing.assert_close(
            p0[n], r, rtol=rtol, atol=atol if param_atol is None else param_atol, msg=lambda m, n=n: f"{n}: {m}"
        )
