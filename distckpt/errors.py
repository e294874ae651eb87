"""Error types raised by distckpt. Every message names the cause and the fix."""

from __future__ import annotations

__all__ = ["ConfigError", "GradDesyncError", "NoGradientError", "RecomputeMismatchError"]


class ConfigError(ValueError):
    """A combination of model, checkpointing and parallel settings that cannot be made right.

    Raised before the first optimizer step; the message names the setting to change.
    """


class GradDesyncError(RuntimeError):
    """Gradients (or replicated parameters) differ across ranks after synchronization."""


class NoGradientError(RuntimeError):
    """Parameters that should train received no gradient on any rank for several checked steps.

    Not a :class:`GradDesyncError`: the ranks agree (on nothing); the fix is in the model or the
    checkpointing mode (a frozen input under reentrant checkpointing, a detached head), not the sync.
    """


class RecomputeMismatchError(RuntimeError):
    """The checkpointed recompute does not reproduce the original forward."""
