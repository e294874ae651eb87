"""Device meshes for ``parallelize``: the 1-D mesh of plain data parallelism and the 2-D
``("replicate", "shard")`` mesh of HSDP (FSDP2 shards within a group of ``shard_size`` ranks, usually
a node, and all-reduces across the groups: ``fully_shard`` does this natively given a 2-D mesh)."""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

from distckpt.errors import ConfigError
from distckpt.options import check_shard_size

__all__ = ["HSDP_DIMS", "build_hsdp_mesh", "check_mesh", "mesh_group", "resolve_mesh"]

HSDP_DIMS = ("replicate", "shard")

_HOW = (
    "Build it with torch.distributed.device_mesh.init_device_mesh(device_type, (world // N, N), "
    "mesh_dim_names=('replicate', 'shard')), or let distckpt build it: parallelize(model, 'hsdp', shard_size=N)."
)


def build_hsdp_mesh(shard_size: int | None, device_type: str) -> Any:
    """The ``(world // shard_size, shard_size)`` mesh named ``("replicate", "shard")``.

    Args:
        shard_size: ranks per shard group; ``None``: ``LOCAL_WORLD_SIZE`` (the ranks of one node, set by
            torchrun).
        device_type: ``"cuda"`` or ``"cpu"``.

    Raises:
        ConfigError: no shard size known, or one that does not divide the world size.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if shard_size is None:
        local = os.environ.get("LOCAL_WORLD_SIZE")
        if not local:
            raise ConfigError(
                "strategy='hsdp' needs shard_size=N (the ranks of one node), or LOCAL_WORLD_SIZE set "
                "by torchrun: pass parallelize(model, 'hsdp', shard_size=N)."
            )
        shard_size = int(local)
    check_shard_size(shard_size, world)
    return init_device_mesh(device_type, (world // shard_size, shard_size), mesh_dim_names=HSDP_DIMS)


def check_mesh(mesh: Any, strategy: str) -> None:
    """Refuse a mesh ``parallelize`` cannot use for ``strategy``: any but a 1-D one or a 2-D
    ``("replicate", "shard")`` one spanning every rank (FSDP1: 1-D only).

    Raises:
        ConfigError: naming the mesh to build instead.
    """
    if mesh is None or mesh.ndim == 1:
        return
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or names != HSDP_DIMS:
        raise ConfigError(
            f"parallelize takes a 1-D device_mesh or a 2-D one named {HSDP_DIMS} (HSDP), got a {mesh.ndim}-D mesh "
            f"named {names or None}. {_HOW}"
        )
    if strategy == "fsdp":
        raise ConfigError(
            "strategy='fsdp' (FSDP1) takes a 1-D device_mesh only; for HSDP over a 2-D mesh use "
            "strategy='fsdp2' with the mesh, or strategy='hsdp' with shard_size=N."
        )
    if mesh.size() != dist.get_world_size():
        raise ConfigError(
            f"the 2-D device_mesh spans {mesh.size()} of the {dist.get_world_size()} ranks; distckpt syncs its "
            f"bookkeeping over the whole world, so the mesh must span every rank. {_HOW}"
        )


def mesh_group(mesh: Any) -> Any:
    """The process group of the data-parallel ranks: a 1-D mesh's group, the world for a 2-D mesh
    (every rank trains on its own data shard, whichever dimension it sits on), or None (the world)."""
    if mesh is None or mesh.ndim != 1:
        return None
    return mesh.get_group()


def resolve_mesh(strategy: str, device_mesh: Any, shard_size: int | None, device_type: str) -> Any:
    """The mesh ``parallelize(model, strategy, device_mesh=..., shard_size=...)`` runs on (checked).

    Raises:
        ConfigError: ``shard_size`` without ``"hsdp"``, ``"hsdp"`` with a 1-D mesh, or a mesh
            :func:`check_mesh` refuses.
    """
    if strategy != "hsdp":
        if shard_size is not None:
            raise ConfigError(
                f"shard_size={shard_size} is for strategy='hsdp' (got {strategy!r}): remove it, or use strategy='hsdp'."
            )
        check_mesh(device_mesh, strategy)
        return device_mesh
    if device_mesh is None:
        return build_hsdp_mesh(shard_size, device_type)
    if shard_size is not None:
        raise ConfigError(
            "strategy='hsdp' got both device_mesh= and shard_size=: pass one (the mesh already says the shard size)."
        )
    check_mesh(device_mesh, strategy)
    if device_mesh.ndim != 2:
        raise ConfigError(f"strategy='hsdp' needs a 2-D device_mesh named {HSDP_DIMS}, got a 1-D one. {_HOW}")
    return device_mesh
