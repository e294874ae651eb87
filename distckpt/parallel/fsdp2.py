"""FSDP2 (``fully_shard``) and HSDP around checkpointed blocks: each block its own unit, the root last."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from distckpt.errors import ConfigError
from distckpt.parallel.mesh import mesh_group
from distckpt.parallel.param_sync import _Unit
from distckpt.parallel.units import Owners, block_units
from distckpt.parallel.zero_bubble import refuse_split_backward

__all__ = ["apply_fsdp2"]


def apply_fsdp2(
    model: nn.Module, names: list[str], owners: Owners, device_mesh: Any, kwargs: dict[str, Any]
) -> tuple[nn.Module, list[tuple[_Unit, bool]], Any]:
    """``fully_shard`` each block (checkpointed or not), then the root; returns the model, its units (each with
    ``prepend=True``: the join must run before FSDP2's post-forward hook reshards the parameters) and the group
    the used bits are all-reduced over (every data-parallel rank: the world for HSDP's 2-D mesh)."""
    from torch.distributed.fsdp import fully_shard

    if "mesh" in kwargs:
        raise ConfigError("pass the mesh as parallelize(..., device_mesh=mesh), not mesh=.")
    blocks, units, root = block_units(model, names, owners)
    # Checkpointing is inside each block's forward; fully_shard each block (checkpointed or not), root last. With a 2-D
    # ("replicate", "shard") mesh fully_shard applies HSDP itself: reduce-scatter within "shard", then
    # all-reduce across "replicate".
    for _, block in blocks:
        fully_shard(block, mesh=device_mesh, **kwargs)
    fully_shard(model, mesh=device_mesh, **kwargs)
    # As a pipeline stage: a zero-bubble schedule's split backward cannot give FSDP2 its gradients (torch 2.13).
    refuse_split_backward(model)
    return model, [(u, True) for u in [*units, root]], mesh_group(device_mesh)
