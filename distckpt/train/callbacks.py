"""Hooks into :func:`distckpt.train.fit`: what the loop calls, so that code outside it (the launcher's
``trainer.callbacks``, tests' fault injection) can act at fixed points of a step without loop switches."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

__all__ = ["Callback"]


class Callback:
    """Subclass and override the hooks you need (each is a no-op here). ``fit`` calls them on every rank.

    Order within one step ``step`` (1-based: the step being computed):

    1. forward and backward of the step's micro-batches (gradients synchronized);
    2. ``on_after_backward(step, model)``: gradients are in ``p.grad``, before the non-finite check,
       clipping and the optimizer step (making a gradient NaN here makes the step non-finite);
    3. the optimizer and scheduler step (or the skip), then ``on_step_end(step, result)`` with this
       step's global losses in ``result.losses``, before logging, evaluation and saving.

    ``on_train_start(step)`` runs once, after a resume (``step``: the optimizer steps already done).
    A hook that needs every rank to agree must itself run a collective on every rank.
    """

    def on_train_start(self, step: int) -> None:
        """Once, after a resume (or none), before the first step."""

    def on_after_backward(self, step: int, model: nn.Module) -> None:
        """After the step's backward, before the non-finite check and the optimizer step."""

    def on_step_end(self, step: int, result: Any) -> None:
        """After the optimizer step; ``result`` is the loop's :class:`~distckpt.train.loop.LoopResult` so far."""
