"""Fault injection for the recovery tests, as :class:`distckpt.train.Callback` hooks the tests install
(``fit(..., callbacks=[...])`` or the launcher's ``trainer.callbacks``); the product carries no test switches.

Launcher form: ``'trainer.callbacks=[{_target_:tests.faults.NanGrads,steps:[2,4]}]'``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from typing import Any

import torch.nn as nn

from distckpt._dist import rank_world
from distckpt.train import Callback


class NanGrads(Callback):
    """Make the gradients NaN at ``steps`` (all steps when ``None``) on ``rank`` (every rank when ``None``).

    The loop then sees a non-finite gradient norm at that step, as after a NaN loss.
    """

    def __init__(self, steps: Sequence[int] | None = None, rank: int | None = None) -> None:
        self.steps = None if steps is None else set(steps)
        self.rank = rank

    def on_after_backward(self, step: int, model: nn.Module) -> None:
        if (self.steps is None or step in self.steps) and self.rank in (None, rank_world()[0]):
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))


class KillAt(Callback):
    """SIGKILL rank ``rank`` right after step ``step``, on torchrun's first attempt only (a worker dying mid-run)."""

    def __init__(self, step: int, rank: int = 1) -> None:
        self.step, self.rank = step, rank

    def on_step_end(self, step: int, result: Any) -> None:
        first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
        if step == self.step and rank_world()[0] == self.rank and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)


def flip_bytes(path: os.PathLike[str] | str, offset: int = 64, n: int = 4096) -> None:
    """Invert ``n`` bytes of ``path`` from ``offset`` (bit rot), keeping its size."""
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(n)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))


def truncate(path: os.PathLike[str] | str, keep: float = 0.5) -> None:
    """Cut ``path`` to ``keep`` of its size (an interrupted copy or a full disk)."""
    size = os.path.getsize(path)
    os.truncate(path, int(size * keep))


__all__ = ["KillAt", "NanGrads", "flip_bytes", "truncate"]
