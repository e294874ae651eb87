"""How the tests and the benchmarks measure a training step: its peak memory (the CPU allocator's events, or
MemTracker, on one process or on each rank under ``distckpt.parallelize``) and its FLOPs (eager, or inside
torch.compile's graphs). One definition, so a test's bound and a benchmark's table measure alike.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

import distckpt
from distckpt.select.profile import as_args, flop_counter, memory_tracker, scalar_loss

CPU = torch.device("cpu")


def train_step(model: nn.Module, opt: torch.optim.Optimizer, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """One AdamW-style step: forward, backward, ``opt.step()``, gradients set to None."""
    scalar_loss(model(*inputs, **kwargs)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


class GraphFlops:
    """The mode the compiled forward and backward graphs run under (``boxed_nop_with_mode``): while
    ``on``, each graph run is counted by a fresh ``FlopCounterMode`` entered inside the compiled code,
    and ``total``/``graphs`` add up. Off, it does nothing (the memory and timing passes)."""

    def __init__(self) -> None:
        self.on = False
        self.total = 0
        self.graphs = 0
        self._open: list[FlopCounterMode] = []

    def __enter__(self) -> GraphFlops:
        if self.on:
            counter = flop_counter()
            counter.__enter__()
            self._open.append(counter)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._open:
            counter = self._open.pop()
            counter.__exit__(*exc)
            self.total += counter.get_total_flops()
            self.graphs += 1


class CompiledBudget(nn.Module):
    """``torch.compile`` with the min-cut partitioner under ``activation_memory_budget=fraction``.

    Backend ``aot_eager_decomp_partition_with_mode``: the same decompositions and partitioner
    (``min_cut_rematerialization_partition``) as ``aot_eager_decomp_partition``, running the graphs
    under :class:`GraphFlops` (checked on torch 2.13.0: both give the same peak). The budget is a
    private torch config read when the graphs are partitioned (first forward); it is patched around
    every forward so a recompilation sees it too. Verified on torch 2.13.0.
    """

    def __init__(self, model: nn.Module, fraction: float):
        super().__init__()
        from torch._dynamo.backends.debugging import aot_eager_decomp_partition_with_mode

        self.fraction = fraction
        self.graph_flops = GraphFlops()
        backend = functools.partial(aot_eager_decomp_partition_with_mode, mode=self.graph_flops)
        self.compiled = torch.compile(model, backend=backend)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        import torch._functorch.config as functorch_config  # private; torch 2.13.0

        with functorch_config.patch(activation_memory_budget=self.fraction):
            return self.compiled(*args, **kwargs)


def storage_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages of ``tensors`` (non-tensors skipped; views and tied tensors once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if torch.is_tensor(t)}
    return sum(storages.values())


def live_bytes(model: nn.Module, opt: torch.optim.Optimizer, inputs: tuple, kwargs: dict) -> int:
    """Bytes of the distinct storages of parameters, buffers, optimizer state and batch."""
    state = [t for s in opt.state.values() for t in s.values()]
    return storage_bytes([*model.parameters(), *model.buffers(), *state, *inputs, *kwargs.values()])


def loss_allocator_peak(model: nn.Module, inputs: dict[str, torch.Tensor]) -> int:
    """The CPU allocator's peak of one forward+backward of ``model(**inputs).loss`` (a Hugging Face
    model), its parameters, buffers and batch included; the gradients are cleared after."""
    live = storage_bytes([*model.parameters(), *model.buffers(), *inputs.values()])
    peak = allocator_peak(lambda: model(**inputs).loss.backward(), live)
    model.zero_grad(set_to_none=True)
    return peak


def allocator_peak(run: Callable[[], Any], live: int) -> int:
    """``live`` (bytes alive before) plus the highest running sum of the CPU allocator's allocation (+)
    and free (-) events while ``run()`` runs, as ``torch.profiler.profile(profile_memory=True)``
    records them: it sees every allocation, eager or compiled, the RNG state checkpointing saves too."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    # The raw events: the FunctionEvent view attributes memory to ops and loses the order.
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    running = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        running += e.nbytes()
        peak = max(peak, running)
    return live + peak


def profiled_peak(model: nn.Module, opt: torch.optim.Optimizer, inputs: tuple, kwargs: dict) -> int:
    """Live bytes at the step's start plus the allocator's peak during one step (:func:`allocator_peak`).
    On the eager rows it equals MemTracker but for the RNG state (the table shows the difference)."""
    return allocator_peak(lambda: train_step(model, opt, inputs, kwargs), live_bytes(model, opt, inputs, kwargs))


def mem_tracker_peak(
    model: nn.Module, opt: torch.optim.Optimizer, inputs: tuple, kwargs: dict, device: torch.device
) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(model, opt, *inputs, *kwargs.values())
    with mt:
        train_step(model, opt, inputs, kwargs)
    return mt.get_tracker_snapshot("peak")[device]["Total"]


def fwd_bwd_flops(model: nn.Module, inputs: tuple, kwargs: dict) -> int:
    if isinstance(model, CompiledBudget):
        counter = model.graph_flops
        counter.on, counter.total, counter.graphs = True, 0, 0
        try:
            scalar_loss(model(*inputs, **kwargs)).backward()
        finally:
            counter.on = False
        model.zero_grad(set_to_none=True)
        return counter.total
    with flop_counter() as counter:
        scalar_loss(model(*inputs, **kwargs)).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def steady_peak(model: nn.Module, inputs: Any) -> int:
    """MemTracker peak of one AdamW step after a first step created the optimizer state."""
    args, kwargs = as_args(inputs)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step() -> None:
        scalar_loss(model(*args, **kwargs)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    mt = memory_tracker(model, opt)
    with mt:  # left by an error too: a tracker left entered keeps its hooks on every later module of the process
        step()
    return mt.get_tracker_snapshot("peak")[CPU]["Total"]


def ddp_buckets(step: Callable[[], None]) -> list[torch.Tensor]:
    """Run ``step`` and return the flat gradient buckets DDP's reducer all-reduced in it. The reducer
    allocates them in C++ (rebuilt in the second step's forward) and keeps them for the rest of training;
    MemTracker only sees a bucket once an op in backward writes into it (the gradient copy-in), so a
    peak in forward or before the first gradient would miss it: they are tracked as external tensors.

    Only floating-point tensors are buckets: the integer and bool ones are distckpt's own per-step
    all-reduce of the used bits (and, under FSDP, the units' forward counts; ``param_sync._reduce_window``),
    a temporary made after the backward's peak. Held here, it was tracked from the step's start: the
    measured peak was 55 B (DDP) and 536 B (FSDP, FSDP2) high on MultiTaskGPT, which read as the
    prediction being under."""
    from distckpt import _torch_compat as compat

    seen: dict[int, torch.Tensor] = {}

    class _Buckets(compat.torch_dispatch_mode()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "allreduce" in str(func):
                for t in _tensors(args):
                    if t.is_floating_point():
                        seen.setdefault(id(t.untyped_storage()), t)
            return func(*args, **(kwargs or {}))

    with _Buckets():
        step()
    return list(seen.values())


def _tensors(value: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def dist_steady_peak(model: nn.Module, strategy: str, inputs: Any, micro_batches: int = 1) -> int:
    """This rank's MemTracker peak of a steady-state AdamW step under ``distckpt.parallelize(strategy)``
    (DDP's buckets counted from the step's start, see :func:`ddp_buckets`); with ``micro_batches > 1``
    gradients are accumulated (``distckpt.accumulate`` around all but the last micro-batch)."""
    args, kwargs = as_args(inputs)
    pm = distckpt.parallelize(model, strategy)
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-4)

    def step(mt: Any = None) -> None:
        for k in range(micro_batches):
            with distckpt.accumulate(pm) if k < micro_batches - 1 else contextlib.nullcontext():
                scalar_loss(pm(*args, **kwargs)).backward()
            if mt is not None and k < micro_batches - 1:
                mt.reset_mod_stats()  # MemTracker refuses a module's second forward otherwise; its peak stays
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    buckets = ddp_buckets(step)  # the second step: DDP rebuilds its buckets in its forward
    mt = memory_tracker(pm, opt, *buckets)
    with mt:
        step(mt)
    return mt.get_tracker_snapshot("peak")[CPU]["Total"]
