"""A training loop written as an Accelerate user writes it, on the ranks of the test pool (tests/harness.py): each
pattern of tests/patterns.py through ``Accelerator.prepare``, its per-step gradients, final parameters and gradient
reductions per micro-batch, for tests/integrations/test_accelerate.py.

The pool's ranks already hold a gloo group and torchrun's variables, so ``Accelerator()`` runs in them as under
torchrun (``MULTI_CPU``), and every pattern runs in one pool call.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedDataParallelKwargs, DistributedType
from patterns import (
    PATTERNS,
    Block,
    HeadBlock,
    LoraBlock,
    MoELayer,
    full_grads,
    full_params,
    make_optimizer,
    micro_batches,
    sequential,
)
from patterns import build as build_net

import distckpt
from distckpt.integrations import accelerate as dc_accelerate
from distckpt.parallel.strategies import attach_ddp

STEPS = 3


class Counter:
    """Gradient reductions (DDP bucket all-reduces) per micro-batch, through DDP's public comm-hook API (the same
    arithmetic as the default hook: divide by the world size, then sum)."""

    def __init__(self) -> None:
        self.count = 0
        self.per_micro_batch: list[int] = []

    def register(self, ddp: torch.nn.Module) -> None:
        world = dist.get_world_size()

        def hook(state, bucket):  # unannotated: DDP checks a hook's annotations (strings here)
            self.count += 1
            fut = dist.all_reduce(bucket.buffer().div_(world), async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])

        ddp.register_comm_hook(None, hook)

    def close_micro_batch(self) -> None:
        self.per_micro_batch.append(self.count)
        self.count = 0


def fresh_accelerator(cpu: bool = True, **kwargs: Any) -> Accelerator:
    """A new Accelerator on this rank (Accelerate keeps its state per process; each fit starts clean)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = Accelerator(cpu=cpu, **kwargs)
    if cpu:
        assert acc.distributed_type == DistributedType.MULTI_CPU and acc.num_processes == dist.get_world_size()
    return acc


@contextlib.contextmanager
def kept_environ() -> Iterator[None]:
    """Accelerator() writes os.environ (ACCELERATE_USE_FSDP with a plugin, ...); the pool's ranks outlive the call."""
    env = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(env)


# Without distckpt (docs/integrations.md's table): Accelerate's DDP with its default flags around blocks wrapped by
# PyTorch's own checkpoint_wrapper (per block, as HF's gradient_checkpointing_enable wraps each layer), non-reentrant
# or reentrant; and non-reentrant with DistributedDataParallelKwargs(find_unused_parameters=True), what DDP's error
# message suggests (and HF Trainer's default for a model it does not checkpoint itself).
OWN = ("torch", "torch_reentrant", "torch_fup")


def _own_checkpointing(model: torch.nn.Module, own: str) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    impl = CheckpointImpl.REENTRANT if own == "torch_reentrant" else CheckpointImpl.NO_REENTRANT
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
        check_fn=lambda m: isinstance(m, (Block, LoraBlock, HeadBlock, MoELayer)),
    )


def fit(
    rank: int,
    world: int,
    name: str,
    *,
    reentrant: bool = False,
    graph: str = "auto",
    guard_every: int = 1,
    perturb: tuple[int, str] | None = None,
    own: str | None = None,
    trigger: bool = False,
) -> tuple[list[dict], dict, list[int], int]:
    """Train pattern ``name`` (AdamW, STEPS optimizer steps): (per-step grads, final params, reductions per
    micro-batch, GradSyncGuard.check() calls). The usual loop runs micro-batches through ``accelerator.accumulate`` with
    ``gradient_accumulation_steps``; the interleaved schedules use ``accelerator.no_sync`` as their accumulate
    context. ``perturb=(rank, param)``: that rank adds 1e-3 to that gradient before each optimizer step.
    ``own``: Accelerate without distckpt (one of OWN). ``trigger``: an interleaved pattern in Accelerate's own way
    (every forward and all but the last backward inside ``no_sync``, the last under ``trigger_sync_in_backward``)."""
    with kept_environ():
        return _fit(rank, world, name, reentrant, graph, guard_every, perturb, own, trigger)


def _fit(rank, world, name, reentrant, graph, guard_every, perturb, own, trigger):
    pattern = PATTERNS[name]
    usual = pattern.schedule is sequential and not trigger
    handlers = [DistributedDataParallelKwargs(find_unused_parameters=True)] if own == "torch_fup" else []
    acc = fresh_accelerator(gradient_accumulation_steps=pattern.micro_batches if usual else 1, kwargs_handlers=handlers)
    model = build_net(pattern)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad])
    if own is None:
        ddp = dc_accelerate.prepare(
            acc, model, blocks=pattern.blocks, reentrant=reentrant, graph=graph, guard_every=guard_every
        )
        opt = acc.prepare(opt)
    else:
        _own_checkpointing(model, own)
        ddp, opt = acc.prepare(model, opt)
    counter = Counter()
    counter.register(ddp)
    grads: list[dict] = []

    def record() -> None:
        grads.append(full_grads(ddp, "ddp"))
        if perturb is not None and rank == perturb[0]:
            dict(ddp.module.named_parameters())[perturb[1]].grad.add_(1e-3)

    for step in range(STEPS):
        xs = micro_batches(pattern, step, rank, world)
        if usual:
            for m, x in enumerate(xs):
                with acc.accumulate(ddp):
                    acc.backward(pattern.loss(ddp, x, step * len(xs) + m, rank))
                    counter.close_micro_batch()
                    if acc.sync_gradients:
                        record()
                    opt.step()
                    opt.zero_grad()
        else:
            if trigger:
                _trigger_schedule(acc, ddp, pattern, xs, step, rank)
            else:
                pattern.schedule(ddp, pattern.loss, xs, step, rank, lambda: acc.no_sync(ddp), 1.0)
            counter.close_micro_batch()
            record()
            opt.step()
            opt.zero_grad()
    guard = dc_accelerate.guard(acc, ddp)
    return grads, full_params(ddp, "ddp"), counter.per_micro_batch, 0 if guard is None else guard.step


def _trigger_schedule(acc: Accelerator, ddp: torch.nn.Module, pattern: Any, xs: list, step: int, rank: int) -> None:
    """Accelerate's documented way to run several forwards before their backwards (``trigger_sync_in_backward``)."""
    with acc.no_sync(ddp):
        losses = [pattern.loss(ddp, x, step * len(xs) + m, rank) / len(xs) for m, x in enumerate(xs)]
        for lo in losses[:-1]:
            lo.backward()
    with acc.trigger_sync_in_backward(ddp):
        losses[-1].backward()


def outcome(rank: int, world: int, name: str, **kwargs: Any) -> tuple:
    """("ok", fit's result), ("refused", error type, message) for distckpt's errors, or ("error", type, first line)
    for anything else when ``own`` is given (what Accelerate alone raises is the measurement)."""
    try:
        return ("ok", fit(rank, world, name, **kwargs))
    except (distckpt.ConfigError, distckpt.GradDesyncError) as e:
        return ("refused", type(e).__name__, str(e))
    except Exception as e:
        if kwargs.get("own") is None:
            raise
        # A rank that raised alone leaves its peer in a collective: close the group (the pool regroups after).
        return ("error", type(e).__name__, (str(e).strip().splitlines() or [""])[0])


def sweep(rank: int, world: int, names: list[str], **kwargs: Any) -> dict[str, tuple]:
    """Every pattern of ``names`` in one call: {name: outcome}."""
    return {name: outcome(rank, world, name, **kwargs) for name in names}


def refusals(rank: int, world: int) -> dict[str, str]:
    """What ``install`` refuses (or warns about) on a live ``MULTI_CPU`` accelerator: {case: "ConfigError: message",
    "warning: message" or "no error"}."""
    from accelerate.utils import DistributedDataParallelKwargs
    from patterns import PATTERNS

    blocks = PATTERNS["all_heads"].blocks

    def attempt(fn: Any) -> str:
        with kept_environ():
            try:
                said = fn()
            except distckpt.ConfigError as e:
                return f"ConfigError: {e}"
            return said or "no error"

    def fup() -> None:
        handler = DistributedDataParallelKwargs(find_unused_parameters=True)
        dc_accelerate.install(fresh_accelerator(kwargs_handlers=[handler]), build_net(PATTERNS["all_heads"]))

    def static() -> None:
        handler = DistributedDataParallelKwargs(static_graph=True)
        dc_accelerate.install(fresh_accelerator(kwargs_handlers=[handler]), build_net(PATTERNS["all_heads"]))

    def accumulate_reentrant() -> None:
        acc = fresh_accelerator(gradient_accumulation_steps=2)
        dc_accelerate.install(acc, build_net(PATTERNS["all_heads"]), blocks=blocks, reentrant=True)

    def no_sync_static() -> None:
        acc = fresh_accelerator()
        ddp = dc_accelerate.prepare(acc, build_net(PATTERNS["all_heads"]), blocks=blocks, graph="static")
        with acc.no_sync(ddp):
            pass

    def not_cpu() -> None:
        dc_accelerate.install(fresh_accelerator(cpu=False), build_net(PATTERNS["all_heads"]))

    def prepared() -> None:
        acc = fresh_accelerator()
        dc_accelerate.install(acc, acc.prepare(build_net(PATTERNS["all_heads"])))

    def wrapped_twice() -> None:
        model = distckpt.wrap(build_net(PATTERNS["all_heads"]), "full", blocks=blocks)
        dc_accelerate.install(fresh_accelerator(), model, policy="full")

    def kept_by_policy_none() -> None:
        model = distckpt.wrap(build_net(PATTERNS["all_heads"]), "full", blocks=blocks)
        acc = fresh_accelerator()
        ddp = dc_accelerate.prepare(acc, model, policy=None)
        assert distckpt.checkpointed(ddp) == ["blocks.0", "blocks.1"], distckpt.checkpointed(ddp)
        assert acc.ddp_handler.find_unused_parameters is False and ddp.static_graph is False

    def fsdp_plugin_on_cpu() -> str:
        import warnings

        from accelerate.utils import FullyShardedDataParallelPlugin

        acc = fresh_accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = dc_accelerate.prepare(acc, build_net(PATTERNS["all_heads"]), blocks=blocks)
        assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel), type(ddp)
        return "warning: " + " | ".join(str(w.message) for w in caught if "FSDP" in str(w.message))

    def attach_not_ddp() -> None:
        attach_ddp(distckpt.wrap(build_net(PATTERNS["all_heads"]), "full", blocks=blocks))

    def attach_twice() -> None:
        attach_ddp(distckpt.parallelize(distckpt.wrap(build_net(PATTERNS["all_heads"]), "full", blocks=blocks)))

    def attach_fup() -> None:
        model = distckpt.wrap(build_net(PATTERNS["all_heads"]), "full", blocks=blocks)
        attach_ddp(torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True))

    def attach_static_mismatch() -> None:
        model = distckpt.wrap(build_net(PATTERNS["all_heads"]), "full", blocks=blocks, reentrant=True)
        attach_ddp(torch.nn.parallel.DistributedDataParallel(model))  # reentrant blocks need static_graph=True

    cases = [
        attach_not_ddp,
        attach_twice,
        attach_fup,
        attach_static_mismatch,
        fsdp_plugin_on_cpu,
        fup,
        static,
        accumulate_reentrant,
        no_sync_static,
        not_cpu,
        prepared,
        wrapped_twice,
        kept_by_policy_none,
    ]
    return {case.__name__: attempt(case) for case in cases}


def rank_forwards(rank: int, world: int) -> tuple:
    """patterns.RANK_FORWARDS (a constant buffer, a second forward on rank 1 only) through ``prepare``: the DDP
    Accelerate builds does not broadcast buffers at every forward (it would hang), and trains exactly."""
    from patterns import RANK_FORWARDS, train_parallel

    with kept_environ():
        acc = fresh_accelerator()
        ddp = dc_accelerate.prepare(acc, build_net(RANK_FORWARDS), blocks=RANK_FORWARDS.blocks)
        assert ddp.forward_sync_buffers is False
        return train_parallel(ddp, RANK_FORWARDS, "ddp", rank, world, steps=STEPS)
