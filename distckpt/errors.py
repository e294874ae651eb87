"""Error types raised by distckpt. Every message names the cause and the fix."""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "GradDesyncError",
    "NoGradientError",
    "RecomputeMismatchError",
    "ResumeError",
    "error_line",
    "first_lines",
]


class ConfigError(ValueError):
    """A combination of model, checkpointing and parallel settings that cannot be made right.

    Raised before the first optimizer step; the message names the setting to change.
    """


class ResumeError(ConfigError):
    """A run cannot resume from its checkpoints: they do not match the model or optimizer, or none is intact.

    A ``ConfigError``: the way out is a setting (``trainer.resume=false`` or a new run folder).
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


def first_lines(e: BaseException, n: int = 1) -> str:
    """The first ``n`` lines of ``e``'s message, stripped and joined by spaces (its type's name when the
    message is empty): how a wrapped error is quoted inside a one- or two-line ``ConfigError``."""
    return " ".join(line.strip() for line in str(e).strip().splitlines()[:n]) or type(e).__name__


def error_line(e: BaseException) -> str:
    """``"Type: first line of the message"`` (the type's name alone when the message is empty): how a
    caught error is reported in one line of a warning or a finding."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
