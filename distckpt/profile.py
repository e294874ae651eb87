"""Activation bytes and recompute cost per candidate block (budget planning, benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.nn as nn

__all__ = ["BlockProfile", "profile_blocks"]


@dataclass(frozen=True)
class BlockProfile:
    fqn: str
    activation_bytes: int
    forward_flops: int


def profile_blocks(model: nn.Module, blocks: list[tuple[str, nn.Module]], example_inputs: Any) -> list[BlockProfile]:
    raise NotImplementedError("profiling is not implemented yet")
