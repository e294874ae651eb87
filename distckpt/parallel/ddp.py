"""DDP around checkpointed blocks: the flags that keep gradients right (``ddp_kwargs`` for a DDP users build,
stricter ones for ``parallelize``'s), its construction, buffer sync, and the audit of a DDP someone else built."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from distckpt.errors import ConfigError
from distckpt.options import check_graph
from distckpt.parallel.mesh import mesh_group
from distckpt.parallel.units import reentrant_blocks

__all__ = ["apply_ddp", "audit_ddp", "ddp_flags", "ddp_kwargs"]


def ddp_kwargs(model: nn.Module, *, graph: str = "auto") -> dict[str, Any]:
    """DDP flags for users who construct ``DistributedDataParallel`` themselves.

    Flags alone cannot make every pattern right (docs/parallel.md): ``parallelize`` also joins
    unused parameters with zero weight. These are the best flags without it: ``static`` ->
    ``static_graph=True``; ``auto``/``dynamic`` -> ``find_unused_parameters=True`` with
    non-reentrant blocks (not two forwards that use different heads before one backward).

    Args:
        model: the model after ``distckpt.apply.wrap``.
        graph: ``"auto"``, ``"static"`` or ``"dynamic"``.

    Returns:
        keyword arguments for ``DistributedDataParallel``.

    Raises:
        ConfigError: reentrant blocks with a graph that may change (no DDP flags are safe for it).
    """
    check_graph(graph)
    if graph == "static":
        return {"find_unused_parameters": False, "static_graph": True}
    if reentrant_blocks(model):
        raise ConfigError(
            f"no DDP flags keep reentrant checkpointing correct when the graph may change (graph={graph!r}): "
            "find_unused_parameters breaks it and static_graph needs the same graph every step. Use "
            "distckpt.wrap(..., reentrant=False), or graph='static' if every step uses the same parameters."
        )
    return {"find_unused_parameters": True, "static_graph": False}


def ddp_flags(kwargs: dict[str, Any], graph: str, reentrant: bool) -> dict[str, Any]:
    """``kwargs`` with the flags ``parallelize``'s DDP needs (no ``find_unused_parameters``; ``static_graph``
    exactly for ``graph='static'`` or reentrant blocks).

    Raises:
        ConfigError: a flag in ``kwargs`` that contradicts them.
    """
    if kwargs.get("find_unused_parameters"):
        raise ConfigError(
            "find_unused_parameters=True is not needed with distckpt.parallelize (unused parameters join the "
            "graph with weight zero) and breaks two forwards before one backward and reentrant checkpointing. "
            "Remove it (distckpt.ddp_kwargs gives it only for a DDP you build yourself, without that join)."
        )
    want_static = graph == "static" or reentrant
    if "static_graph" in kwargs and bool(kwargs["static_graph"]) != want_static:
        why = (
            (
                "graph='static' needs it"
                if graph == "static"
                else "reentrant blocks need it (each block's gradients arrive in a nested backward)"
            )
            if want_static
            else f"graph={graph!r} says the used parameters may change between steps"
        )
        raise ConfigError(
            f"static_graph={kwargs['static_graph']} contradicts the setup: {why}. Remove static_graph and let "
            "distckpt choose."
        )
    return {**kwargs, "find_unused_parameters": False, "static_graph": want_static}


def apply_ddp(
    model: nn.Module, graph: str, device_mesh: Any, device: torch.device, kwargs: dict[str, Any]
) -> tuple[nn.Module, Any]:
    """``DistributedDataParallel(model)`` with :func:`ddp_flags`; returns it and its data-parallel group."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    flags = ddp_flags(kwargs, graph, bool(reentrant_blocks(model)))
    if "broadcast_buffers" not in flags and "forward_sync_buffers" not in flags:
        # DDP's own name since torch 2.13 (broadcast_buffers is deprecated): the buffers are still synced at init, and
        # running statistics once per step (distckpt.parallel.buffers), which pairs whatever forwards each rank runs.
        flags["forward_sync_buffers"] = False
    if device_mesh is not None and device_mesh.ndim == 1:
        flags["device_mesh"] = device_mesh
    # A 2-D mesh spans the world (checked): DDP replicates over all of it, its default group.
    group = flags.get("process_group") or mesh_group(device_mesh)
    wrapped = DDP(model, device_ids=[device] if device.type == "cuda" else None, **flags)
    return wrapped, group


def audit_ddp(model: nn.Module) -> None:
    """``preflight``'s DDP checks on a DDP that ``parallelize`` did not build: reentrant blocks need
    ``static_graph=True`` and no ``find_unused_parameters``.

    Raises:
        ConfigError: naming the cause and the fix.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel) or not reentrant_blocks(model):
        return
    if model.find_unused_parameters:
        raise ConfigError(
            "reentrant checkpointing with find_unused_parameters=True fails with 'Expected to mark a variable "
            "ready only once' (the nested backward marks parameters DDP already declared unused). Use "
            "distckpt.wrap(..., reentrant=False), or DDP(static_graph=True) for a graph that never changes."
        )
    if not model.static_graph:
        raise ConfigError(
            "reentrant checkpointing without static_graph breaks on two forwards before one backward and "
            "silently desyncs LoRA-style models (pytorch#121594). Use distckpt.wrap(..., reentrant=False), "
            "or DDP(static_graph=True) for a graph that never changes."
        )
