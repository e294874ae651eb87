"""parallelize / preflight / accumulate / attach_ddp: DDP, FSDP, FSDP2 and HSDP around checkpointed blocks, with
gradients equal to a single-process run for every multi-task pattern (see distckpt.parallel.param_sync). Each engine's
construction lives in its own module (``ddp``, ``fsdp1``, ``fsdp2``); this one fixes their order and attaches the
sync state."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from distckpt import _torch_compat as compat
from distckpt.apply.compile import apply_compile, compiled_blocks
from distckpt.apply.state import pending_plan
from distckpt.apply.wrap import hand_over, parallel_kind
from distckpt.errors import ConfigError
from distckpt.layout import Layout
from distckpt.options import Engine, accumulate_refusal, check_graph, engine_of, reentrant_refusal
from distckpt.parallel.ddp import apply_ddp, audit_ddp, ddp_flags, ddp_kwargs, sync_buffers_each_forward
from distckpt.parallel.fsdp1 import apply_fsdp1, audit_fsdp1
from distckpt.parallel.fsdp2 import apply_fsdp2
from distckpt.parallel.mesh import resolve_layout
from distckpt.parallel.param_sync import SyncState
from distckpt.parallel.state import attach_state, sync_state
from distckpt.parallel.tp import tp_mesh_of
from distckpt.parallel.units import (
    owners_of,
    reentrant_blocks,
    reentrant_params,
    refuse_conditional_units,
    root_unit,
)
from distckpt.runtime.swap import _clean_fqn, is_checkpointed

__all__ = [
    "accumulate",
    "attach_ddp",
    "ddp_kwargs",
    "parallelize",
    "preflight",
    "sync_buffers_each_forward",
    "sync_state",
]


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --- parallelize --------------------------------------------------------------------------------


def parallelize(
    model: nn.Module,
    strategy: str | Layout = "ddp",
    *,
    graph: str = "auto",
    device_mesh: Any = None,
    shard_size: int | None = None,
    compile: Any = None,
    **kwargs: Any,
) -> nn.Module:
    """Wrap a model whose blocks ``distckpt.apply.wrap`` checkpointed in DDP, FSDP or FSDP2, correctly.

    Order (fixed): tensor parallel (the user's, if any) and checkpointing are already inside the blocks; FSDP
    wraps each block (checkpointed or not; ``use_orig_params=True``) then the root; FSDP2 ``fully_shard``s each
    block, then the root; DDP wraps the root. Then every unit's forward gets the zero-weight join of its
    parameters, and the end of backward resets the grads of parameters no rank used to None.

    Args:
        model: the model, after ``distckpt.apply.wrap``.
        strategy: ``"ddp"``, ``"fsdp"`` (FSDP1), ``"fsdp2"`` (``fully_shard``), ``"hsdp"`` (``fully_shard``
            over a 2-D ``("replicate", "shard")`` mesh: sharded within ``shard_size`` ranks, replicated
            across those groups) or ``"none"``; or a :class:`distckpt.layout.Layout` (which then says the
            shard size and compile options too).
        graph: ``"auto"`` and ``"dynamic"``: any pattern (unused params joined with weight zero);
            ``"static"``: the same params every step and rank (DDP ``static_graph=True``, no join),
            checked each step.
        device_mesh: a 1-D DeviceMesh for FSDP2/FSDP/DDP (default: the world), or a 2-D one named
            ``("replicate", "shard")`` spanning every rank: FSDP2 (and ``"hsdp"``) then apply HSDP, DDP
            replicates over all its ranks. A model made tensor-parallel over ``mesh["tp"]`` (torch's
            ``parallelize_module``) takes the ``("dp", "tp")`` mesh or ``mesh["dp"]``, under ``"fsdp2"``.
        shard_size: ``"hsdp"`` only: ranks per shard group, dividing the world size (default:
            ``LOCAL_WORLD_SIZE``, the ranks of one node); distckpt builds the mesh.
        compile: compile each block (checkpoint included) before sharding: ``True``, a dict of
            ``torch.compile`` arguments or a ``CompileOptions`` (see ``distckpt.apply.compile``).
        **kwargs: passed to DDP / FSDP / ``fully_shard`` (mixed precision, ``bucket_cap_mb``, ...).

    Returns:
        the parallel model (DDP or FSDP wrapper; for FSDP2 the model itself).

    Raises:
        ConfigError: unknown strategy or graph, no process group, a model already wrapped, a mesh of
            another shape (the message says how to build one), or a kwarg that contradicts what
            correctness needs.
    """
    check_graph(graph)
    name = strategy.strategy if isinstance(strategy, Layout) else strategy
    if engine_of(name) is not Engine.NONE:  # engine_of checks the name first
        _refuse_unready(model, name)
    layout, device_mesh = resolve_layout(strategy, device_mesh, shard_size, compile, _device().type, tp_mesh_of(model))
    # The hand-over point: a budget is planned for the layout used here (before any unit exists).
    hand_over(model, layout)
    if layout.engine is Engine.NONE:
        return model if layout.compile is None else apply_compile(model, layout.compile)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    owners = owners_of(model, names)
    re_idx = reentrant_params(model, names)
    if re_idx and reentrant_refusal(layout.engine):
        raise ConfigError(reentrant_refusal(layout.engine))

    # The order is fixed: checkpointing already sits inside the blocks (distckpt.wrap); then (compile=) each block is
    # compiled, checkpoint included; then FSDP/FSDP2 wrap each block (wrap's candidates, checkpointed or not) and the
    # root last, or DDP wraps the root. Their hooks stay outside the compiled code.
    if layout.compile is not None:
        apply_compile(model, layout.compile)
    if layout.engine is Engine.DDP:
        wrapped, group = apply_ddp(model, graph, device_mesh, _device(), kwargs)
        units = [(root_unit(model, names, owners), False)]
    elif layout.engine is Engine.FSDP1:
        wrapped, units, group = apply_fsdp1(model, names, owners, device_mesh, _device(), kwargs)
    else:
        wrapped, units, group = apply_fsdp2(model, names, owners, device_mesh, kwargs)

    compiled_idx: set[int] = set()
    if layout.compile is not None:
        blocks = compiled_blocks(model)
        compiled_idx = {i for i, n in enumerate(names) if any(n.startswith(b + ".") for b in blocks)}
    attach_state(wrapped, names, re_idx, units, group, layout=layout, graph=graph, compiled=compiled_idx)
    return wrapped


def attach_ddp(ddp: nn.Module, *, graph: str = "auto", keep_buffer_sync: bool = False) -> SyncState:
    """Give a ``DistributedDataParallel`` that someone else built (Accelerate, HF Trainer) what ``parallelize``
    gives its own: the zero-weight join of unused parameters in every forward, the used-set checks, the firing
    counts of reentrant blocks and ``distckpt.accumulate``'s bookkeeping. Call it right after DDP is built,
    before its first forward.

    Args:
        ddp: a ``DistributedDataParallel`` around a model whose blocks ``distckpt.wrap`` checkpointed, built with
            ``find_unused_parameters=False`` and ``static_graph=True`` exactly for ``graph='static'`` or reentrant
            blocks (what ``parallelize`` sets).
        graph: as ``parallelize``'s.
        keep_buffer_sync: keep the DDP's buffer sync at every forward as built (the user chose it); otherwise it is
            turned off for a model without running statistics, as ``parallelize`` builds it
            (:func:`sync_buffers_each_forward`).

    Returns:
        the state, also kept on ``ddp``: ``distckpt.accumulate(ddp)`` and ``GradSyncGuard`` work as after
        ``parallelize``.

    Raises:
        ConfigError: not a DDP, distckpt's state already attached, DDP flags that contradict what correctness
            needs, or what ``preflight`` refuses.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    check_graph(graph)
    if not isinstance(ddp, DDP):
        raise ConfigError(
            f"distckpt attaches its gradient-sync state to a DistributedDataParallel only, got {type(ddp).__name__}. "
            "Use distckpt.parallelize(model, strategy) to build FSDP/FSDP2 with distckpt."
        )
    if sync_state(ddp) is not None:
        raise ConfigError(
            "this DistributedDataParallel already has distckpt's gradient-sync state (built by distckpt.parallelize, "
            "or attached before). Attach it once, to a DDP built around the plain model."
        )
    model = ddp.module
    # The rules parallelize applies to the DDP it builds, read from the flags this one was built with.
    flags = {"find_unused_parameters": ddp.find_unused_parameters, "static_graph": ddp.static_graph}
    ddp_flags(flags, graph, bool(reentrant_blocks(model)))
    preflight(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    units = [(root_unit(model, names, owners_of(model, names)), False)]
    if not keep_buffer_sync and not sync_buffers_each_forward(model):
        ddp.forward_sync_buffers = False  # after its init sync, as parallelize's DDP (sync_buffers_each_forward)
    layout = Layout.of("ddp", world_size=dist.get_world_size(ddp.process_group))
    return attach_state(
        ddp,
        names,
        reentrant_params(model, names),
        units,
        ddp.process_group,
        layout=layout,
        graph=graph,
        compiled=set(),
    )


def _refuse_unready(model: nn.Module, strategy: str) -> None:
    """What parallelize refuses before building anything: no process group, a model already wrapped,
    a budget still waiting for its first forward under FSDP, and what preflight refuses."""
    if not dist.is_initialized():
        raise ConfigError(
            f"strategy={strategy!r} needs torch.distributed initialized: run under torchrun and call "
            "dist.init_process_group first, or use strategy='none'."
        )
    kind = parallel_kind(model)
    if kind:
        raise ConfigError(
            f"distckpt.parallelize got a model already wrapped in {kind}. Pass the plain model (after "
            "distckpt.wrap); parallelize applies the wrapper itself."
        )
    sharded = engine_of(strategy).sharded
    if sharded and pending_plan(model):
        raise ConfigError(
            f"distckpt.wrap(model, budget) has not chosen its blocks yet (it waits for the first forward), but "
            f"{strategy} shards each block now, after which a block's checkpointing cannot change. Pass "
            "example_inputs=(a batch) to distckpt.wrap."
        )
    preflight(model)
    if sharded:
        refuse_conditional_units(model, strategy)


# --- preflight ----------------------------------------------------------------------------------


def preflight(model: nn.Module) -> None:
    """Audit a model wrapped (by the user or by ``parallelize``) around checkpointed blocks.

    Checks: checkpointing sits inside FSDP units (pytorch#82203), reentrant checkpointing is not
    combined with ``find_unused_parameters`` or without ``static_graph``, no PyTorch
    ``checkpoint_wrapper`` wraps a DDP/FSDP module, and FSDP1 units keep each parameter's gradient.

    Args:
        model: a DDP/FSDP-wrapped or FSDP2-sharded model, or a plain one.

    Raises:
        ConfigError: naming the cause and the fix.
    """
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    parallel_types = (DistributedDataParallel, FullyShardedDataParallel, FSDPModule)
    for name, m in model.named_modules():
        inner = [n for n, c in m.named_modules() if n and isinstance(c, parallel_types)]
        if (is_checkpointed(m) or isinstance(m, compat.checkpoint_wrapper_class())) and inner:
            where = _clean_fqn(name) or type(m).__name__
            raise ConfigError(
                f"{where} is checkpointed around the FSDP/DDP unit {_clean_fqn(inner[0])}: the recompute runs "
                "outside the unit's unshard/reshard (pytorch#82203). Checkpoint the blocks first "
                "(distckpt.wrap), then shard them: distckpt.parallelize does both in that order."
            )
    if sync_state(model) is not None:
        return  # built by parallelize
    audit_ddp(model)
    audit_fsdp1(model)


# --- accumulate ---------------------------------------------------------------------------------


@contextlib.contextmanager
def accumulate(model: nn.Module) -> Iterator[None]:
    """No gradient sync for the micro-batches run inside: DDP/FSDP ``no_sync``, FSDP2
    ``set_requires_gradient_sync(False)``. Run forward and backward inside; run the last
    micro-batch outside, where gradients are reduced once for the whole window.

    Args:
        model: the model ``parallelize`` returned (or a user-built DDP/FSDP/FSDP2 model).
    """
    from torch.distributed.fsdp import FSDPModule

    state = sync_state(model)
    if getattr(model, "static_graph", False):
        # What parallelize recorded (a user-built DDP with static_graph=True has no state: its graph is static).
        reentrant = state is not None and bool(state.reentrant)
        graph = "static" if state is None or state.static_check else "auto"
        raise ConfigError(accumulate_refusal(Engine.DDP, reentrant=reentrant, graph=graph))
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        ctx: Any = contextlib.nullcontext()
    elif hasattr(model, "no_sync"):
        ctx = model.no_sync()
    else:
        ctx = contextlib.nullcontext()
    if state is not None:
        state.sync = False
    try:
        with ctx:
            yield
    finally:
        if state is not None:
            state.sync = True
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(True)
