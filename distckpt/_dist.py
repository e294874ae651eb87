"""Small process-group helpers shared by the library, the training loop and the launcher."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["local_tensor", "rank_world"]


def rank_world(group: Any = None) -> tuple[int, int]:
    """``(rank, world size)`` in ``group`` (default: the whole job), or ``(0, 1)`` without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's (FSDP2) local shard, any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t
