"""distckpt's gradient-sync state on a DeepSpeed ZeRO engine (:class:`ZeroSyncState`), and every private DeepSpeed
API distckpt touches, each with its reason and the version it was verified on (deepspeed 0.19.8). Imports no
DeepSpeed: it works on the engine and optimizer objects it is given.

Why a fixed order: ZeRO-2 and ZeRO-3 copy each gradient into a flat bucket in the order its hook fires and reduce
the bucket as one tensor. When ranks use different parameters (a task head per rank), the hooks fire in different
orders, so ranks add up different parameters' gradients (silently when the shapes match, gloo's "Received data size
doesn't match expected size" when not). The join gives every parameter a gradient on every rank; this state then
hands them to ZeRO in one order, the optimizer's own parameter order, at the end of each backward.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from distckpt import _torch_compat as compat
from distckpt.errors import ConfigError, GradDesyncError
from distckpt.layout import Layout
from distckpt.parallel.param_sync import SyncState

__all__ = ["ZeroSyncState", "defers_reduction", "engine_backward_running", "skip_shm_build", "zero_stage"]


# --- DeepSpeed internals (deepspeed 0.19.8) ------------------------------------------------------------------------


def zero_stage(engine: Any) -> int:
    """The engine's ZeRO stage (0-3): ``DeepSpeedEngine.zero_optimization_stage()`` (public)."""
    return int(engine.zero_optimization_stage())


def defers_reduction(optimizer: Any, stage: int) -> bool:
    """Whether ZeRO reduces gradients from their hooks, in the order they fire: ZeRO-2/3 always, ZeRO-1 with
    ``overlap_comm`` (``DeepSpeedZeroOptimizer.process_gradients``). ZeRO-1 otherwise reduces at the end of backward,
    in parameter order (``reduce_gradients``), which needs no reordering."""
    return stage >= 2 or bool(getattr(optimizer, "overlap_comm", False))


def _set_deferred(optimizer: Any, on: bool) -> None:
    # ``_coalesce_grad_reduction`` is the switch behind DeepSpeed's public ``engine.coalesce_grad_reduction()``: while
    # on, a gradient hook leaves the gradient on its parameter (process_gradients / reduce_ready_partitions_and_
    # remove_grads return at once). That context spans a whole step and ends with DeepSpeed's own flush and epilogue,
    # which engine.backward runs again; distckpt needs the same switch per backward, with its flush only.
    optimizer._coalesce_grad_reduction = on


def _reduce_in_order(optimizer: Any, stage: int) -> None:
    """What each deferred hook would have done, in the optimizer's parameter order. DeepSpeed's flush in
    ``engine._flush_coalesced_reduction_zero12/zero3`` (0.19.8) loops the same way; engine.backward's epilogue then
    reduces the last bucket and fills the partitions as after any backward."""
    if stage == 3:
        for group in optimizer.fp16_groups:
            for p in group:
                if p.requires_grad and p.grad is not None:
                    optimizer.reduce_ready_partitions_and_remove_grads(p)
        return
    for i, group in enumerate(optimizer.bit16_groups):
        for p in group:
            if p.requires_grad and optimizer.get_gradient_for_reduction(p) is not None:
                optimizer.process_gradients(p, i)


def _has_grad(optimizer: Any, stage: int) -> list[tuple[nn.Parameter, bool]]:
    """Each trainable parameter in the optimizer's order, and whether a gradient waits for ZeRO's reduction."""
    if stage == 3:
        return [(p, p.grad is not None) for group in optimizer.fp16_groups for p in group if p.requires_grad]
    return [
        (p, optimizer.get_gradient_for_reduction(p) is not None)
        for group in optimizer.bit16_groups
        for p in group
        if p.requires_grad
    ]


def skip_shm_build(ops: Any) -> None:
    """Tell DeepSpeed (``deepspeed.ops``, passed in) that its shared-memory all-reduce cannot be built here.

    On the CPU accelerator, creating DeepSpeed's communication backend (the first ``deepspeed.initialize`` or
    ``deepspeed.init_distributed``) JIT-compiles ``deepspeed_shm_comm`` with ninja when a compiler is found: 163 s on
    this 2-core machine, cached in ``TORCH_EXTENSIONS_DIR`` (``~/.cache/torch_extensions``); a rank killed meanwhile
    leaves a ``lock`` file there that makes the next run wait forever. Training never uses it (only
    ``inference_all_reduce`` does). ``deepspeed.ops.__compatible_ops__`` is the probed table that
    ``deepspeed.comm.torch.build_shm_op`` reads; its module docstring says edits to it persist (0.19.8). Setting the
    table also skips probing the other ops (compiler runs), which only that function reads.
    """
    ops.__compatible_ops__ = {"deepspeed_shm_comm": False}


def engine_backward_running(engine: Any) -> bool:
    """Whether ``engine.backward(loss)`` is running (``DeepSpeedEngine._running_engine_backward``, 0.19.8): its
    epilogue runs after the autograd pass, so after distckpt's flush. A plain ``loss.backward()`` runs DeepSpeed's
    epilogue from a callback queued before distckpt's, which would reduce before the flush."""
    return bool(getattr(engine, "_running_engine_backward", True))


# --- the state -----------------------------------------------------------------------------------------------------


class ZeroSyncState(SyncState):
    """:class:`~distckpt.parallel.param_sync.SyncState` on a DeepSpeed engine: the zero-weight join in the units'
    forwards (the root under ZeRO-1/2, where every parameter is whole; under ZeRO-3 the root too, whose parameters
    outside the blocks DeepSpeed gathers for the whole forward), then at the end of each backward: one all-reduce that
    checks every parameter's gradient is present on all ranks or none, and the gradients handed to ZeRO in the
    optimizer's order (:func:`defers_reduction`). Never-used parameters keep their zero gradient: ZeRO's flat
    partitions hold a gradient for every parameter (as DeepSpeed does without distckpt), so the reset to None does
    not apply.

    Args:
        engine: the ``DeepSpeedEngine`` (held weakly).
        names, registered, mode, reentrant, static_check: as ``SyncState``'s.
        group: the data-parallel group of ZeRO's reduction.
    """

    def __init__(
        self,
        engine: Any,
        names: list[str],
        registered: list[nn.Parameter],
        mode: str,
        group: Any,
        reentrant: set[int],
        static_check: bool = False,
    ):
        self.stage = zero_stage(engine)
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        # The layout says how the join runs: at the root over whole parameters (ZeRO-1/2, as DDP's), or in units
        # whose parameters are gathered there (ZeRO-3, as FSDP2's). Nothing below reduces as DDP or FSDP would.
        layout = Layout.of("fsdp2" if self.stage == 3 else "ddp", world_size=world)
        super().__init__(names, registered, mode, group, layout, reentrant, static_check=static_check)
        self.strategy = f"DeepSpeed ZeRO-{self.stage}"
        self._engine = weakref.ref(engine)
        self.optimizer = engine.optimizer
        self.index = {id(p): i for i, p in enumerate(registered)}
        # ZeRO-3 always, graph='static' too: measured (0.19.8, CPU), DeepSpeed's own hook-driven reduction with
        # distckpt's ZeRO-3 units (root-gathered parameters, leaf modules) leaves gradients on parameters, and its
        # zero_grad then fails ('unknown parameter type' from record_stream); the in-order flush removes every one.
        self.defer = (mode == "join" or self.stage == 3) and defers_reduction(self.optimizer, self.stage)
        if self.defer:
            _set_deferred(self.optimizer, True)

    def _begin_pass(self, task: int, rec: Any) -> None:
        if self.stage == 3 and torch.is_grad_enabled():  # grad mode in backward: create_graph=True
            raise ConfigError(
                "a backward with create_graph=True (a gradient penalty, a Hessian-vector product) ran through a "
                "DeepSpeed ZeRO-3 engine, which releases the gathered parameters the double-backward graph points to "
                "(measured without distckpt: 'mat2 must be a matrix'). Compute this loss outside DeepSpeed "
                "(distckpt.parallelize(model, 'ddp'))."
            )
        if self.stage < 3 and not compat.is_plain_backward():
            raise ConfigError(
                f"torch.autograd.grad (or backward(inputs=...)) ran through a {self.strategy} engine's outputs: "
                "DeepSpeed runs its gradient-reduction epilogue at the end of that pass, before the loss's backward, "
                "and fails there (IndexError in reduce_ipg_grads, measured with deepspeed 0.19.8 with or without "
                "distckpt). Use ZeRO-3, or take the gradient outside the engine."
            )
        super()._begin_pass(task, rec)

    def _end_of_backward(self, reduces: bool) -> None:
        engine = self._engine()
        if self.defer and engine is not None and not engine_backward_running(engine):
            raise ConfigError(
                f"a backward through a {self.strategy} engine ran as loss.backward(): DeepSpeed then reduces the "
                "gradients before distckpt can order them. Call engine.backward(loss) (Accelerate and HF Trainer do)."
            )
        if self.defer or self.stage < 2:  # gradients still wait on their parameters for ZeRO's reduction
            self._check_present()
        if self.defer:
            _set_deferred(self.optimizer, False)
            try:
                _reduce_in_order(self.optimizer, self.stage)
            finally:
                _set_deferred(self.optimizer, True)
        super()._end_of_backward(False)  # the pass's bookkeeping; no reset: ZeRO's partitions hold every gradient

    def _check_present(self) -> None:
        """One all-reduce: a gradient present on some ranks only would make ZeRO's buckets differ across ranks."""
        present = _has_grad(self.optimizer, self.stage)
        flags = torch.tensor([int(h) for _, h in present], dtype=torch.int64)
        red = self._allreduce(torch.cat([flags, -flags]))
        n = len(present)
        bad = [k for k in range(n) if red[k] != -red[n + k]]
        if not bad:
            return
        names = [self.names[self.index[id(present[k][0])]] if id(present[k][0]) in self.index else "?" for k in bad]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise GradDesyncError(
            f"{self.strategy}: {shown} got a gradient on some ranks only in step {self.step}, so ZeRO's reduction "
            "would add up different parameters across ranks. Under ZeRO-3 a parameter inside a block that some ranks "
            "do not use (a mixture-of-experts expert, a head inside a block) needs its block to be a DeepSpeed leaf "
            "module: deepspeed.utils.set_z3_leaf_modules(model, [<block class>]) before distckpt's initialize."
        )

    def remove(self) -> None:
        super().remove()
        if self.defer:
            _set_deferred(self.optimizer, False)
