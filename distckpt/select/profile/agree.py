"""Every rank's profile made the same (the largest any rank measured), so that every rank checkpoints the
same blocks in the same modes: a rank that chose differently would desynchronize DDP/FSDP.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch


def _agree(profile: Any) -> Any:
    """``profile`` (a :class:`~distckpt.select.profile.ModelProfile`, which imports this module: its fields are
    read off the object) with every rank's numbers made the same, the largest any rank measured, so that every
    rank checkpoints the same blocks; a rank that chose differently would desynchronize DDP/FSDP."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return profile
    block_fields = (
        [f.name for f in dataclasses.fields(profile.blocks[0]) if f.name not in ("fqn", "recompute_ops")]
        if profile.blocks
        else []
    )
    model_fields = [f.name for f in dataclasses.fields(profile) if f.name not in ("blocks", "device", "run_order")]
    values = [getattr(b, f) for b in profile.blocks for f in block_fields]
    values += [getattr(profile, f) for f in model_fields]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    agreed = t.tolist()
    k = len(block_fields)
    ops = _agreed_ops([b.recompute_ops for b in profile.blocks], device)
    blocks = tuple(
        dataclasses.replace(b, **dict(zip(block_fields, agreed[i * k : (i + 1) * k])), recompute_ops=ops[i])
        for i, b in enumerate(profile.blocks)
    )
    rest = dict(zip(model_fields, agreed[len(blocks) * k :]))
    return dataclasses.replace(profile, blocks=blocks, **rest)


def _agreed_ops(ops: list[tuple[tuple[str, int, int, int], ...]], device: Any) -> list[tuple[Any, ...]]:
    """:attr:`BlockProfile.recompute_ops` the same on every rank: the largest bytes and FLOPs of each call
    where every rank recorded the same calls (op names and indices, compared by a digest), else none
    (``()``: no per-op choice for any block, on every rank)."""
    import torch.distributed as dist

    digest = hashlib.sha256(repr([[(name, index) for name, index, *_ in b] for b in ops]).encode()).digest()
    code = int.from_bytes(digest[:7], "big")  # fits int64
    numbers = [x for b in ops for _, _, nbytes, flops in b for x in (nbytes, flops)]
    same = torch.tensor([code, -code], dtype=torch.int64, device=device)  # the largest and the smallest digest
    dist.all_reduce(same, op=dist.ReduceOp.MAX)
    if same.tolist() != [code, -code]:
        return [()] * len(ops)  # the calls differ between ranks: no per-op choice anywhere
    t = torch.tensor(numbers, dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    agreed = iter(t.tolist())
    return [tuple((name, index, next(agreed), next(agreed)) for name, index, *_ in b) for b in ops]
