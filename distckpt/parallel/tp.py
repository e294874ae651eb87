"""Tensor parallel under ``parallelize``: the mesh a model's tensor-parallel parameters live on (torch's
``parallelize_module`` applied over ``mesh["tp"]`` before ``distckpt.wrap``), and the torchtitan-style plan for
transformer blocks that the launcher applies (attention and MLP input projections column-wise, output projections
row-wise), with the checks that each rank holds whole attention heads."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from distckpt.errors import ConfigError

__all__ = ["COLWISE", "ROWWISE", "apply_tp", "check_heads", "tp_mesh_of", "transformer_plan"]

# Linear layers by their name in a block: the input projections of attention and MLP split their outputs
# (column-wise: each rank computes its heads, its slice of the MLP), the output projections their inputs
# (row-wise: each rank's partial sums are all-reduced). HF Llama/Mistral/Qwen2, the launcher's gpt, torchtitan's
# wq/wk/wv/wo and feed-forward w1/w3 (in), w2 (out).
COLWISE = frozenset(
    {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q", "k", "v", "fc", "wq", "wk", "wv", "w1", "w3"}
)
ROWWISE = frozenset({"o_proj", "down_proj", "proj", "fc_out", "wo", "w2"})

# Attributes that say how many attention heads (or key/value heads) a module or HF config splits its width into.
_HEAD_ATTRS = ("n_head", "num_heads", "n_heads", "num_attention_heads", "num_key_value_heads", "n_kv_heads")


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


def _linears(block: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [(n, m) for n, m in block.named_modules() if isinstance(m, nn.Linear)]


def transformer_plan(blocks: list[tuple[str, nn.Module]]) -> dict[str, Any]:
    """The tensor-parallel plan of transformer ``blocks`` (fqn, module) for ``parallelize_module``: the linears named
    in :data:`COLWISE` column-wise, in :data:`ROWWISE` row-wise (local outputs, as torchtitan; the block's input and
    output stay replicated).

    Raises:
        ConfigError: a block without such linears (no known attention/MLP names: write the plan yourself).
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for fqn, block in blocks:
        mine = {}
        for name, _ in _linears(block):
            leaf = name.rpartition(".")[2]
            if leaf in COLWISE:
                mine[f"{fqn}.{name}"] = ColwiseParallel()
            elif leaf in ROWWISE:
                mine[f"{fqn}.{name}"] = RowwiseParallel()
        col = sum(isinstance(s, ColwiseParallel) for s in mine.values())
        if not col or col == len(mine):
            raise ConfigError(
                f"no tensor-parallel plan for {fqn} ({type(block).__name__}): distckpt's plan splits linears named "
                f"{sorted(COLWISE)} column-wise and {sorted(ROWWISE)} row-wise (Llama-style attention and MLP). "
                "Apply torch.distributed.tensor.parallel.parallelize_module with your own plan, or use tp=1."
            )
        plan.update(mine)
    return plan


def check_heads(model: nn.Module, blocks: list[tuple[str, nn.Module]], plan: dict[str, Any], tp: int) -> None:
    """Refuse a ``tp`` that does not split each attention into whole heads, or a column-wise linear's width.

    Raises:
        ConfigError: naming the count that ``tp`` does not divide.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel

    seen: dict[str, int] = {}
    config = getattr(model, "config", None) or getattr(getattr(model, "lm", None), "config", None)
    for owner in [config, *(m for _, b in blocks for m in b.modules())]:
        for attr in _HEAD_ATTRS:
            value = getattr(owner, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                seen.setdefault(attr, value)
    for attr, n in seen.items():
        if n % tp:
            raise ConfigError(
                f"tp={tp} does not divide the model's {attr}={n}: each tensor-parallel rank computes whole attention "
                f"heads. Use a tp that divides {n}."
            )
    for fqn in plan:
        lin = model.get_submodule(fqn)
        width = lin.out_features if isinstance(plan[fqn], ColwiseParallel) else lin.in_features
        if width % tp:
            raise ConfigError(f"tp={tp} does not divide {fqn}'s width {width}. Use a tp that divides it.")


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

    plan = transformer_plan(blocks)
    check_heads(model, blocks, plan, mesh.size())
    parallelize_module(model, mesh, plan)
    return plan
