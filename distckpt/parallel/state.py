"""The gradient-sync state a parallel model carries (distckpt.parallel.param_sync.SyncState): attached once, by
``parallelize`` or ``attach_ddp``, under one attribute where ``accumulate``, ``preflight``, ``GradSyncGuard`` and the
integrations find it."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from distckpt.layout import Layout
from distckpt.options import Engine
from distckpt.parallel.param_sync import SyncState, _Unit
from distckpt.parallel.units import reentrant_blocks
from distckpt.runtime.swap import _clean_fqn

__all__ = ["STATE_ATTR", "attach_state", "sync_state"]

STATE_ATTR = "_distckpt_sync"  # attribute of the parallel model holding its SyncState


def sync_state(model: nn.Module) -> SyncState | None:
    """The sync state ``parallelize``/``attach_ddp`` attached to ``model``, or None."""
    return getattr(model, STATE_ATTR, None)


def attach_state(
    wrapped: nn.Module,
    names: list[str],
    re_idx: set[int],
    units: list[tuple[_Unit, bool]],
    group: Any,
    *,
    layout: Layout,
    graph: str,
    compiled: set[int],
) -> SyncState:
    """Every unit's forward makes all its parameters take part (distckpt.parallel.param_sync); the state is kept on
    ``wrapped``.

    Args:
        wrapped: the parallel model.
        names: clean FQNs of the trainable parameters, in the order of ``wrapped.named_parameters()``.
        re_idx: indices of the parameters inside reentrant-checkpointed blocks.
        units: each unit and whether its forward hook goes first (``prepend``).
        group: the data-parallel process group (None: the world).
        layout: how the model runs.
        graph: ``"auto"``, ``"static"`` or ``"dynamic"``.
        compiled: indices of the parameters inside blocks compiled per block.
    """
    # DDP's static graph needs no such join; FSDP has no such flag, so graph='static' joins there too (a used set
    # that differs across ranks would otherwise desync its reduce-scatter before the check runs).
    ddp = layout.engine is Engine.DDP
    mode = "static" if graph == "static" and ddp else "join"
    registered_by_name = {_clean_fqn(n): p for n, p in wrapped.named_parameters()}
    state = SyncState(
        names,
        [registered_by_name[n] for n in names],
        mode,
        group,
        layout,
        re_idx,
        static_check=graph == "static",
        ddp=wrapped if ddp else None,
    )
    state.compiled = compiled
    for block in reentrant_blocks(wrapped):
        block._distckpt_synced = True  # the state refuses autograd.grad through it (no guard edges: they would fire)
    for unit, prepend in units:
        state.attach(unit, prepend)
    if re_idx and ddp:
        state.count_reentrant_firings([(i, state.registered[i]) for i in sorted(re_idx)])
    setattr(wrapped, STATE_ATTR, state)
    return state
