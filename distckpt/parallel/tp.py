"""Tensor parallel under ``parallelize``: the mesh a model's tensor-parallel parameters live on (torch's
``parallelize_module`` applied over ``mesh["tp"]`` before ``distckpt.wrap``), and the torchtitan-style plan for
transformer blocks that the launcher applies (attention and MLP input projections column-wise, output projections
row-wise), with the checks that each rank holds whole attention heads."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from distckpt.errors import ConfigError
from distckpt.select.tp_shapes import check_heads, tp_roles

__all__ = ["apply_tp", "tp_mesh_of", "transformer_plan"]


def tp_mesh_of(model: nn.Module) -> Any:
    """The mesh of the model's tensor-parallel parameters (DTensors before any data parallelism), or None.

    Raises:
        ConfigError: parameters on several meshes, or on a mesh of more than one dimension.
    """
    from torch.distributed.tensor import DTensor

    meshes = {}
    for name, p in model.named_parameters():
        if isinstance(p, DTensor):
            meshes.setdefault(tuple(p.device_mesh.mesh.flatten().tolist()), (name, p.device_mesh))
    if not meshes:
        return None
    if len(meshes) > 1:
        (a, _), (b, _) = list(meshes.values())[:2]
        raise ConfigError(
            f"the tensor-parallel parameters live on different meshes ({a} and {b}): distckpt runs one tensor-parallel "
            "dimension. Apply parallelize_module to every block over the same mesh['tp']."
        )
    name, mesh = next(iter(meshes.values()))
    if mesh.ndim != 1:
        raise ConfigError(
            f"{name} is a DTensor over a {mesh.ndim}-D mesh before parallelize: apply tensor parallel over the 1-D "
            "mesh['tp'] and let parallelize shard over mesh['dp'] (pass the model before fully_shard)."
        )
    return mesh


def transformer_plan(blocks: list[tuple[str, nn.Module]]) -> dict[str, Any]:
    """The tensor-parallel plan of transformer ``blocks`` (fqn, module) for ``parallelize_module``: the linears
    :func:`distckpt.select.tp_shapes.tp_roles` names, column-wise or row-wise (local outputs, as torchtitan; the
    block's input and output stay replicated).

    Raises:
        ConfigError: a block without such linears (no known attention/MLP names: write the plan yourself).
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        fqn: ColwiseParallel() if role == "colwise" else RowwiseParallel() for fqn, role in tp_roles(blocks).items()
    }


def apply_tp(model: nn.Module, mesh: Any, blocks: list[tuple[str, nn.Module]]) -> dict[str, Any]:
    """Tensor parallel on the transformer ``blocks`` of ``model`` over the 1-D ``mesh`` (``mesh["tp"]``), with
    :func:`transformer_plan`; the rest of the model (embeddings, norms outside blocks, task heads) stays replicated.
    The first step of the order (TP, checkpointing, compile, FSDP): call it before ``distckpt.wrap``.

    Returns:
        the plan applied.

    Raises:
        ConfigError: no plan for the blocks, or a mesh size that does not split the heads.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    check_heads(model, blocks, tp_roles(blocks), mesh.size())
    plan = transformer_plan(blocks)
    parallelize_module(model, mesh, plan)
    return plan
