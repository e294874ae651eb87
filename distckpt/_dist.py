"""Small process-group helpers shared by the library, the training loop and the launcher."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "broadcast_object",
    "grad_meta",
    "local_shard",
    "local_tensor",
    "rank_world",
    "shard_key",
    "unwrap_ddp",
    "zero_grad",
]


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


def grad_meta(t: torch.Tensor) -> tuple[Any, ...]:
    """What :func:`zero_grad` needs to build a zero gradient for ``t`` later (no tensor is kept): its shape, dtype
    and device, and for a DTensor (a tensor-parallel weight, FSDP2's unsharded parameter) its mesh, placements and
    local shape as well."""
    types = _dtensor_types()
    if types and isinstance(t, types[0]):
        with torch.no_grad():  # to_local() without grad is the shard itself, no autograd node
            local = t.to_local()
        return (t.shape, t.dtype, local.device, t.device_mesh, t.placements, local.shape, t.stride())
    return (t.shape, t.dtype, t.device)


def zero_grad(meta: tuple[Any, ...]) -> torch.Tensor:
    """A zero gradient for the tensor :func:`grad_meta` described: an expanded scalar (no allocation); for a DTensor
    a DTensor of that mesh and placements around a local zero, as FSDP2 and TP require of a DTensor parameter's
    gradient (a plain tensor raises ``Expected DTensor`` in FSDP2's post-backward).

    The DTensor's local zero is allocated: autograd's AccumulateGrad keeps a DTensor gradient whose (global) strides
    look dense as it is, and the next backward of an accumulation window adds to it in place, which an expanded
    scalar refuses ("more than one element of the written-to tensor refers to a single memory location")."""
    if len(meta) == 3:
        shape, dtype, device = meta
        return torch.zeros((), dtype=dtype, device=device).expand(shape)
    shape, dtype, device, mesh, placements, local_shape, stride = meta
    local = torch.zeros(local_shape, dtype=dtype, device=device)
    # shape/stride given: no collective to infer them (uneven shards included), run_check=False: no broadcast.
    return _dtensor_types()[0].from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
