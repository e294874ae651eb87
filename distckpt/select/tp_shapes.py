"""Tensor parallel as the memory plan sees it: which linears of a transformer block a torchtitan-style plan splits
(attention and MLP input projections column-wise, output projections row-wise), the check that each rank keeps
whole attention heads, and the block's shapes on one tensor-parallel rank, which ``distckpt plan`` traces on fake
tensors (parameters and the activations between the split linears are ``1/tp``; the block's input and output stay
whole). ``distckpt.parallel.tp`` applies the same plan with torch's ``parallelize_module``."""

from __future__ import annotations

import torch
import torch.nn as nn

from distckpt.errors import ConfigError

__all__ = ["COLWISE", "ROWWISE", "check_heads", "shrink_for_tp", "tp_roles"]

# Linear layers by their name in a block: the input projections of attention and MLP split their outputs
# (column-wise: each rank computes its heads, its slice of the MLP), the output projections their inputs
# (row-wise: each rank's partial sums are all-reduced). HF Llama/Mistral/Qwen2, the launcher's gpt, torchtitan's
# wq/wk/wv/wo and feed-forward w1/w3 (in), w2 (out).
COLWISE = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "q", "k", "v", "fc"})
COLWISE |= frozenset({"wq", "wk", "wv", "w1", "w3"})
ROWWISE = frozenset({"o_proj", "down_proj", "proj", "fc_out", "wo", "w2"})

# Attributes that say how many attention heads (or key/value heads) a module or HF config splits its width into.
_HEAD_ATTRS = ("n_head", "num_heads", "n_heads", "num_attention_heads", "num_key_value_heads", "n_kv_heads")


def tp_roles(blocks: list[tuple[str, nn.Module]]) -> dict[str, str]:
    """``{linear fqn: "colwise" | "rowwise"}`` for the linears of ``blocks`` (fqn, module) named in :data:`COLWISE`
    and :data:`ROWWISE`.

    Raises:
        ConfigError: a block without both kinds (no known attention/MLP names: write the plan yourself).
    """
    roles: dict[str, str] = {}
    for fqn, block in blocks:
        mine = {}
        for name, m in block.named_modules():
            leaf = name.rpartition(".")[2]
            if isinstance(m, nn.Linear) and leaf in COLWISE:
                mine[f"{fqn}.{name}"] = "colwise"
            elif isinstance(m, nn.Linear) and leaf in ROWWISE:
                mine[f"{fqn}.{name}"] = "rowwise"
        if set(mine.values()) != {"colwise", "rowwise"}:
            raise ConfigError(
                f"no tensor-parallel plan for {fqn} ({type(block).__name__}): distckpt's plan splits linears named "
                f"{sorted(COLWISE)} column-wise and {sorted(ROWWISE)} row-wise (Llama-style attention and MLP). "
                "Apply torch.distributed.tensor.parallel.parallelize_module with your own plan, or use tp=1."
            )
        roles.update(mine)
    return roles


def check_heads(model: nn.Module, blocks: list[tuple[str, nn.Module]], roles: dict[str, str], tp: int) -> None:
    """Refuse a ``tp`` that does not split each attention into whole heads, or a split linear's width.

    Raises:
        ConfigError: naming the count that ``tp`` does not divide.
    """
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
    for fqn, role in roles.items():
        lin = model.get_submodule(fqn)
        width = lin.out_features if role == "colwise" else lin.in_features
        if width % tp:
            raise ConfigError(f"tp={tp} does not divide {fqn}'s width {width}. Use a tp that divides it.")


def shrink_for_tp(model: nn.Module, blocks: list[tuple[str, nn.Module]], tp: int) -> None:
    """Give the planned linears of ``blocks`` the shapes one tensor-parallel rank holds, in place (column-wise: the
    output features and bias ``/ tp``; row-wise: the input features ``/ tp``, the bias whole), new parameters made
    as the old ones are (fake tensors under ``FakeTensorMode``). A block that reads its head count from the width
    (``view(..., -1, head_dim)``: HF Llama, the launcher's gpt) then runs as on one rank.

    Raises:
        ConfigError: as :func:`tp_roles` and :func:`check_heads`.
    """
    roles = tp_roles(blocks)
    check_heads(model, blocks, roles, tp)
    for fqn, role in roles.items():
        lin = model.get_submodule(fqn)
        if role == "colwise":
            lin.out_features //= tp
            shapes = {"weight": (lin.out_features, lin.in_features), "bias": (lin.out_features,)}
        else:
            lin.in_features //= tp
            shapes = {"weight": (lin.out_features, lin.in_features)}
        for name, shape in shapes.items():
            old = getattr(lin, name)
            if old is not None:
                new = torch.empty(shape, dtype=old.dtype, device=old.device)
                setattr(lin, name, nn.Parameter(new, requires_grad=old.requires_grad))
