"""Accelerate's own DDP made exact by distckpt: ``install`` checkpoints the blocks, hands the ``Accelerator`` distckpt's
DDP flags and attaches distckpt's gradient-sync state to the DDP that ``accelerator.prepare`` builds; ``prepare`` does
both in one call. HF Trainer builds its DDP through ``accelerator.prepare`` too (distckpt.integrations.hf).

docs/integrations.md ("Accelerate") says what Accelerate gives without distckpt, measured, and what holds with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, DistributedType
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import distckpt
from distckpt._log import notify
from distckpt.apply.wrap import hand_over, parallel_kind
from distckpt.errors import ConfigError
from distckpt.integrations._common import check_guard_every, checkpoint_blocks
from distckpt.layout import Layout
from distckpt.options import Engine, accumulate_refusal, check_graph
from distckpt.parallel.param_sync import SyncState
from distckpt.parallel.state import sync_state
from distckpt.parallel.strategies import attach_ddp
from distckpt.parallel.units import reentrant_blocks

__all__ = ["forget", "guard", "install", "prepare"]

_HOOKS = "_distckpt_hooks"  # attribute of the Accelerator holding its _Hooks

# Accelerate builds torch's DistributedDataParallel itself for these (Accelerator.prepare_model).
_DDP_TYPES = {
    DistributedType.MULTI_CPU,
    DistributedType.MULTI_GPU,
    DistributedType.MULTI_XPU,
    DistributedType.MULTI_NPU,
    DistributedType.MULTI_MLU,
    DistributedType.MULTI_SDAA,
    DistributedType.MULTI_MUSA,
    DistributedType.MULTI_HPU,
    DistributedType.MULTI_NEURON,
}


def install(
    accelerator: Accelerator,
    model: nn.Module,
    *,
    policy: Any = "full",
    blocks: Any = None,
    reentrant: bool = False,
    graph: str = "auto",
    guard_every: int = 0,
) -> None:
    """Make the DDP that ``accelerator`` will build around ``model`` exact, as ``distckpt.parallelize``'s is.

    Call it after the ``Accelerator`` exists and before it prepares ``model``. It ``distckpt.wrap``s the blocks
    (in place), sets the accelerator's ``DistributedDataParallelKwargs`` to distckpt's flags
    (``find_unused_parameters=False``; ``static_graph=True`` exactly for ``graph='static'`` or reentrant blocks;
    the user's other DDP settings kept), and arranges, on this accelerator object only, that:

    - when it prepares THIS model (``accelerator.prepare(model, ...)`` or ``accelerator.prepare_model(model)``,
      as HF Trainer calls them), the DDP it builds gets distckpt's sync state (``distckpt.parallel.strategies.
      attach_ddp``: the zero-weight join of unused parameters in every forward, the used-set checks, the reentrant
      firing counts) and, with ``guard_every``, a ``GradSyncGuard`` (on the state's DDP);
    - ``accelerator.no_sync(ddp)`` and therefore ``accelerator.accumulate(ddp)`` run ``distckpt.accumulate(ddp)``:
      DDP's ``no_sync`` plus distckpt's bookkeeping (refused with a ConfigError under DDP's static graph, which
      cannot skip a sync); ``accelerator.trigger_sync_in_backward(ddp)`` tells the state that backward reduces;
    - with ``guard_every=N``, ``GradSyncGuard.check()`` runs before every N-th real optimizer step of every
      optimizer this accelerator prepares (before or after the model) over the model's parameters: a step
      pre-hook on the optimizer inside Accelerate's ``AcceleratedOptimizer``, so micro-batches whose step
      Accelerate skips are not counted. A desync raises ``GradDesyncError`` on every rank, naming the parameter.

    For HF Trainer (distckpt.integrations.hf): call ``install(trainer.accelerator, trainer.model, ...)`` after
    ``Trainer(...)`` (which builds the accelerator) and before ``trainer.train()`` (which prepares the model).
    Trainer's own ``DistributedDataParallelKwargs`` carries ``find_unused_parameters=True`` unless
    ``TrainingArguments(ddp_find_unused_parameters=False)``: ``install`` refuses it as a user's setting, so a caller
    that knows the value is Trainer's default (``args.ddp_find_unused_parameters is None``) resets
    ``trainer.accelerator.ddp_handler.find_unused_parameters = False`` first. The prepared DDP is
    ``trainer.model_wrapped``; its state is ``distckpt.parallel.state.sync_state(ddp)`` and its guard
    :func:`guard` (``None`` before prepare or without ``guard_every``).

    Why hooks on the instance (attributes that shadow ``Accelerator``'s methods on this object) rather than patching
    the ``Accelerator`` class: other accelerators in the process (an evaluation one, a second Trainer) keep
    Accelerate's behaviour, nothing changes at import, and models this accelerator prepares without ``install``
    pass through untouched.

    Args:
        accelerator: the ``Accelerator``; its distributed type must be one where Accelerate builds DDP
            (``MULTI_CPU``, ``MULTI_GPU``, ...) or ``NO`` (one process: only the checkpointing applies).
        model: the plain model (not yet prepared).
        policy: ``distckpt.wrap``'s policy (``"full"``, ``"every:2"``, ``"budget:2GiB"``, ...); ``None`` keeps the
            checkpointing the model already has from ``distckpt.wrap`` (or none).
        blocks: ``distckpt.wrap``'s ``blocks=``.
        reentrant: ``distckpt.wrap``'s ``reentrant=`` (DDP then runs with ``static_graph=True``: no accumulation).
        graph: ``distckpt.parallelize``'s ``graph=``.
        guard_every: ``GradSyncGuard.check()`` before every ``guard_every``-th optimizer step (0: never).

    Raises:
        ConfigError: an accelerator distckpt cannot make exact (FSDP, DeepSpeed, Megatron-LM, XLA, tensor
            parallelism, Accelerate's torch.compile, fewer processes than running ranks), DDP kwargs that contradict
            distckpt's (``find_unused_parameters=True``, a contradicting ``static_graph``), gradient accumulation with
            DDP's static graph, a model already prepared, a model already wrapped with ``distckpt.wrap`` and a
            ``policy``, and what ``distckpt.wrap`` refuses.
    """
    check_graph(graph)
    check_guard_every(guard_every, "install")
    _refuse_accelerator(accelerator)
    kind = parallel_kind(model)
    if kind or getattr(model, "_is_accelerate_prepared", False):
        raise ConfigError(
            f"distckpt.integrations.accelerate.install got a model already prepared ({kind or 'by Accelerate'}). Call "
            "it with the plain model, before accelerator.prepare."
        )
    if accelerator.ddp_handler is not None and accelerator.ddp_handler.find_unused_parameters:
        raise ConfigError(_FUP)
    checkpoint_blocks(model, policy, blocks=blocks, reentrant=reentrant, owner="install")
    static = _ddp_handler_flags(accelerator, model, graph)
    if accelerator.gradient_accumulation_steps > 1 and static:
        why = accumulate_refusal(Engine.DDP, reentrant=bool(reentrant_blocks(model)), graph=graph)
        raise ConfigError(f"Accelerator(gradient_accumulation_steps={accelerator.gradient_accumulation_steps}): {why}")
    hooks = _Hooks.on(accelerator)
    hooks.models[id(model)] = _Installed(model, graph, guard_every)


def prepare(
    accelerator: Accelerator,
    model: nn.Module,
    *,
    policy: Any = "full",
    blocks: Any = None,
    reentrant: bool = False,
    graph: str = "auto",
    guard_every: int = 0,
) -> nn.Module:
    """:func:`install`, then ``accelerator.prepare(model)``. Prepare the optimizer and data loaders with
    ``accelerator.prepare`` as usual (before or after).

    Args:
        accelerator, model, policy, blocks, reentrant, graph, guard_every: as :func:`install`.

    Returns:
        the prepared model (a ``DistributedDataParallel`` with distckpt's sync state; the model itself on one
        process).

    Raises:
        ConfigError: what :func:`install` refuses.
    """
    install(accelerator, model, policy=policy, blocks=blocks, reentrant=reentrant, graph=graph, guard_every=guard_every)
    return accelerator.prepare(model)


def guard(accelerator: Accelerator, model: nn.Module) -> distckpt.GradSyncGuard | None:
    """The ``GradSyncGuard`` :func:`install` made for ``model`` (the plain model or its prepared DDP), or None
    (not prepared yet, or ``guard_every=0``)."""
    hooks: _Hooks | None = accelerator.__dict__.get(_HOOKS)
    inst = hooks.find(model) if hooks is not None else None
    return inst.guard if inst is not None else None


def forget(accelerator: Accelerator, model: nn.Module) -> None:
    """Undo :func:`install` for ``model`` on ``accelerator``: the hooks of the DDP built around it go, and Accelerate
    prepares it as it would without distckpt. For a model that is replaced (HF Trainer's ``model_init`` builds a new
    one in ``train()``), so the accelerator holds no reference to it. Nothing happens for a model not installed.

    Args:
        accelerator: the ``Accelerator`` :func:`install` was called with.
        model: the plain model given to :func:`install`.
    """
    hooks: _Hooks | None = accelerator.__dict__.get(_HOOKS)
    inst = hooks.models.get(id(model)) if hooks is not None else None
    if inst is None or inst.model is not model:
        return
    state = inst.state()
    if state is not None:
        state.remove()
    del hooks.models[id(model)]


# --- refusals ----------------------------------------------------------------------------------------------------

_FUP = (
    "DistributedDataParallelKwargs(find_unused_parameters=True) is not needed with distckpt (unused parameters join "
    "the graph with weight zero in every forward) and breaks two forwards before one backward and reentrant "
    "checkpointing. Remove it from the Accelerator's kwargs_handlers (HF Trainer: "
    "TrainingArguments(ddp_find_unused_parameters=False))."
)


def _refuse_accelerator(accelerator: Accelerator) -> None:
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        raise ConfigError(
            "Accelerate's FSDP plugin wraps the model in FSDP units distckpt does not choose, so its zero-weight join "
            "cannot run inside them. Build FSDP with distckpt instead: model = distckpt.parallelize(model, 'fsdp') "
            "(or 'fsdp2') after distckpt.wrap, prepare only the optimizer and data loaders with Accelerate, and "
            "accumulate with distckpt.accumulate(model)."
        )
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1 and accelerator.num_processes != world:
        # Measured (accelerate 1.16, torchrun on CPU): Accelerator() without cpu=True says NO, 1 process, on every
        # rank, and prepare builds no DDP: each rank trains alone.
        raise ConfigError(
            f"the Accelerator sees {accelerator.num_processes} process(es) ({kind.value}) but {world} ranks are "
            "running, so it would build no DistributedDataParallel and every rank would train alone. On CPU pass "
            "Accelerator(cpu=True); on GPUs launch with accelerate launch --multi_gpu or torchrun."
        )
    if kind != DistributedType.NO and kind not in _DDP_TYPES:
        raise ConfigError(
            f"distckpt makes Accelerate's DistributedDataParallel exact, but this Accelerator runs {kind.value}, whose "
            "gradient sync distckpt cannot reach. Launch without it (plain DDP: accelerate launch --multi_gpu, or "
            "torchrun), or use distckpt.parallelize directly."
        )
    pc = getattr(accelerator, "parallelism_config", None)
    if pc is not None and (pc.tp_enabled or getattr(pc, "cp_enabled", False)):
        raise ConfigError(
            "ParallelismConfig with tensor or context parallelism: Accelerate then does not build plain DDP, which is "
            "what distckpt makes exact. Drop parallelism_config, or use distckpt.parallelize."
        )
    if kind in _DDP_TYPES and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        # Measured (accelerate 1.16): Accelerator(cpu=True, fsdp_plugin=...) sets ACCELERATE_USE_FSDP, then picks
        # MULTI_CPU and builds DDP without a word (Accelerate selects FSDP for accelerator devices only).
        notify(
            f"Accelerate ignored its FSDP plugin ({kind.value}: it builds DistributedDataParallel), so distckpt makes "
            "that DDP exact. For FSDP on CPU use distckpt.parallelize(model, 'fsdp') or 'fsdp2'.",
            stacklevel=3,
        )
    dynamo = getattr(accelerator.state, "dynamo_plugin", None)
    if dynamo is not None and str(getattr(dynamo.backend, "value", dynamo.backend)).upper() != "NO":
        raise ConfigError(
            "Accelerate's torch.compile (dynamo_backend) compiles the DDP model as a whole, around distckpt's hooks. "
            "Drop dynamo_backend and compile per block with distckpt.parallelize(model, 'ddp', compile=True)."
        )


def _ddp_handler_flags(accelerator: Accelerator, model: nn.Module, graph: str) -> bool:
    """Set the accelerator's DDP kwargs to distckpt's flags, keeping the user's others; refuse contradictions.
    Returns whether DDP runs with ``static_graph=True``."""
    static = graph == "static" or bool(reentrant_blocks(model))
    handler = accelerator.ddp_handler or DistributedDataParallelKwargs()
    if handler.find_unused_parameters:
        raise ConfigError(_FUP)
    if handler.static_graph and not static:
        raise ConfigError(
            f"DistributedDataParallelKwargs(static_graph=True) contradicts graph={graph!r}, which says the used "
            "parameters may change between steps (DDP's static graph would desync or fail). Remove static_graph "
            "and let distckpt choose, or pass graph='static' if every step uses the same parameters."
        )
    # A dataclass copy: the user's handler object (maybe shared with another Accelerator) stays as it was.
    accelerator.ddp_handler = dataclasses.replace(handler, find_unused_parameters=False, static_graph=static)
    return static


# --- the hooks on one accelerator --------------------------------------------------------------------------------


class _Installed:
    """One model ``install`` was called for: its settings, and what its prepare built."""

    def __init__(self, model: nn.Module, graph: str, guard_every: int):
        self.model, self.graph, self.guard_every = model, graph, guard_every
        self.ddp: DistributedDataParallel | None = None
        self.guard: distckpt.GradSyncGuard | None = None

    def state(self) -> SyncState | None:
        return sync_state(self.ddp) if self.ddp is not None else None

    def built(self, accelerator: Accelerator, prepared: nn.Module) -> None:
        """Attach distckpt's state (and guard) to the DDP Accelerate just built around the model."""
        old = self.state()
        if old is not None:  # prepared again (a second Trainer.train): the old DDP's hooks go
            old.remove()
        self.ddp, self.guard = None, None
        if isinstance(prepared, DistributedDataParallel) and prepared.module is self.model:
            # The buffer sync at every forward hangs when ranks run different numbers of forwards: attach_ddp turns
            # it off for a model without running statistics unless the user set broadcast_buffers (to_kwargs holds
            # what differs from the defaults, so an explicit True reads as the default).
            handler = accelerator.ddp_handler
            chosen = handler is not None and "broadcast_buffers" in handler.to_kwargs()
            attach_ddp(prepared, graph=self.graph, keep_buffer_sync=chosen)
            self.ddp = prepared
        elif accelerator.use_distributed and any(p.requires_grad for p in self.model.parameters()):
            raise ConfigError(
                f"accelerator.prepare returned {type(prepared).__name__}, not the DistributedDataParallel distckpt "
                "expects around the model, so distckpt cannot keep its gradients in sync. Remove the option that "
                "wraps it otherwise, or use distckpt.parallelize."
            )
        if self.guard_every:
            self.guard = distckpt.GradSyncGuard(prepared, every=self.guard_every)

    def check(self) -> None:
        if self.guard is not None:
            self.guard.check()


class _Hooks:
    """The methods ``install`` shadows on one ``Accelerator`` instance, and the models it watches."""

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator
        self.models: dict[int, _Installed] = {}
        # The class's methods, bound to this accelerator: what the shadowing attributes call.
        self._prepare_model = accelerator.prepare_model
        self._prepare_optimizer = accelerator.prepare_optimizer
        self._no_sync = accelerator.no_sync
        self._trigger = accelerator.trigger_sync_in_backward
        self._hooked: set[int] = set()  # ids of the optimizers given the guard's step pre-hook

    @classmethod
    def on(cls, accelerator: Accelerator) -> _Hooks:
        hooks = accelerator.__dict__.get(_HOOKS)
        if hooks is None:
            hooks = cls(accelerator)
            # Instance attributes shadow Accelerator's methods for this object only (see install's docstring);
            # Accelerate calls them as self.prepare_model / self.no_sync, so its own prepare and accumulate reach them.
            accelerator.prepare_model = hooks.prepare_model
            accelerator.prepare_optimizer = hooks.prepare_optimizer
            accelerator.no_sync = hooks.no_sync
            accelerator.trigger_sync_in_backward = hooks.trigger_sync_in_backward
            accelerator.__dict__[_HOOKS] = hooks
        return hooks

    def find(self, model: nn.Module) -> _Installed | None:
        inst = self.models.get(id(model))
        if inst is not None and inst.model is model:
            return inst
        return next((i for i in self.models.values() if i.ddp is not None and i.ddp is model), None)

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        inst = self.models.get(id(model))
        if inst is None or inst.model is not model or evaluation_mode:
            return self._prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        # Re-read here: the DDP kwargs may have changed since install (a Trainer, a user), and a budget policy is
        # planned for the world it runs in, before DDP exists (parallelize's hand-over point).
        _ddp_handler_flags(self.accelerator, model, inst.graph)
        hand_over(model, Layout.of("ddp", world_size=self.accelerator.num_processes))
        prepared = self._prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        inst.built(self.accelerator, prepared)
        self._hook_optimizers()
        return prepared

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None):
        prepared = self._prepare_optimizer(optimizer, device_placement=device_placement)
        self._hook_optimizers()
        return prepared

    def _hook_optimizers(self) -> None:
        """The guard's step pre-hook on each prepared optimizer over a watched model's parameters. On the optimizer
        inside AcceleratedOptimizer: Accelerate calls its step only on micro-batches that synced."""
        for acc_opt in self.accelerator._optimizers:
            inner = getattr(acc_opt, "optimizer", acc_opt)
            if id(inner) in self._hooked:
                continue
            params = {id(p) for group in inner.param_groups for p in group["params"]}
            for inst in self.models.values():
                if inst.guard_every and any(id(p) in params for p in inst.model.parameters()):
                    self._hooked.add(id(inner))
                    inner.register_step_pre_hook(lambda _opt, _args, _kwargs, inst=inst: inst.check())
                    break

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        inst = self.find(model)
        if inst is None or inst.ddp is not model:
            with self._no_sync(model):
                yield
            return
        # DDP's no_sync plus distckpt's bookkeeping (what distckpt.accumulate does), and its refusal under DDP's
        # static graph, which asserts in its reducer when a step skips the sync.
        with distckpt.accumulate(model):
            yield

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model: nn.Module) -> Iterator[None]:
        with self._trigger(model):
            inst = self.find(model)
            state = inst.state() if inst is not None and inst.ddp is model else None
            if state is not None:
                state.arm()  # Accelerate prepared DDP's reducer after the forwards: this backward reduces
            yield
