"""What every framework integration checks and does alike: the guard's period, and checkpointing the blocks (or
keeping the model's own distckpt checkpointing). Imports no framework."""

from __future__ import annotations

from typing import Any

from torch import nn

import distckpt
from distckpt.errors import ConfigError


def check_guard_every(guard_every: Any, owner: str) -> None:
    """Refuse a ``guard_every`` that is not an int >= 0 (0: no guard, N: every N-th optimizer step)."""
    if not isinstance(guard_every, int) or isinstance(guard_every, bool) or guard_every < 0:
        raise ConfigError(
            f"{owner}(guard_every={guard_every!r}): an int >= 0 (0 turns GradSyncGuard off, N checks every N-th "
            "optimizer step)."
        )


def checkpoint_blocks(model: nn.Module, policy: Any, *, blocks: Any, reentrant: bool, owner: str) -> None:
    """``distckpt.wrap`` the blocks, unless ``policy=None`` keeps the model's own distckpt checkpointing.

    Raises:
        ConfigError: the model already has distckpt checkpointing and ``policy`` is not None (it would wrap twice).
    """
    if policy is None:
        return
    done = distckpt.checkpointed(model)
    if done:
        raise ConfigError(
            f"{type(model).__name__} already checkpoints {done[0]} with distckpt.wrap, and {owner} was given "
            f"policy={policy!r} too. Pass policy=None to keep the model's own choice, or remove that distckpt.wrap "
            "call."
        )
    distckpt.wrap(model, policy, blocks=blocks, reentrant=reentrant)
