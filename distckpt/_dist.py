"""Small process-group helpers shared by the library, the training loop and the launcher."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["broadcast_object", "local_shard", "local_tensor", "rank_world", "shard_key", "unwrap_ddp"]


def rank_world(group: Any = None) -> tuple[int, int]:
    """``(rank, world size)`` in ``group`` (default: the whole job), or ``(0, 1)`` without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (``obj`` itself without a process group): one decision for all."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's (FSDP2) local shard, any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def unwrap_ddp(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module under DDP (FSDP keeps its wrappers in the tree; their names are cleaned)."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


_DTENSOR: Any = None


def _dtensor_types() -> Any:
    global _DTENSOR
    if _DTENSOR is None:
        try:
            from torch.distributed.tensor import DTensor, Replicate

            _DTENSOR = (DTensor, Replicate)
        except ImportError:  # pragma: no cover - torch without distributed
            _DTENSOR = ()
    return _DTENSOR


def local_shard(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The tensor this rank holds, and whether other ranks hold other parts of it (a sharded DTensor)."""
    types = _dtensor_types()
    if types and isinstance(t, types[0]):
        return t.to_local(), not all(isinstance(p, types[1]) for p in t.placements)
    return t, False


def shard_key(t: torch.Tensor) -> int:
    """Which part of ``t`` this rank holds: 0 for a tensor every rank holds whole (a plain tensor, a
    DTensor placed ``Replicate`` on every mesh dimension), else ``1 +`` this rank's index over the mesh
    dimensions that shard it. Ranks with equal keys hold the same values when in sync: under HSDP
    (``(Replicate, Shard)`` on a ``("replicate", "shard")`` mesh) the ranks of one shard column."""
    types = _dtensor_types()
    if not types or not isinstance(t, types[0]):
        return 0
    mesh, coord = t.device_mesh, t.device_mesh.get_coordinate()
    split = [dim for dim, placement in enumerate(t.placements) if not isinstance(placement, types[1])]
    if not split:
        return 0
    key = 0
    for dim in split:
        key = key * mesh.size(dim) + coord[dim]
    return key + 1
