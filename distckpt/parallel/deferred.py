"""Reduction windows that close at the optimizer's step: ``torch.distributed.pipelining`` turns FSDP2's gradient sync
off for every micro-batch's backward and reduces them all after the schedule, outside autograd
(``perform_reduce_grad``), so no backward of the step can end the window. The sync state
(:mod:`distckpt.parallel.param_sync`) then closes it (the used bits all-reduced, the gradients of parameters no rank
used reset to None) right before ``optimizer.step()`` over its parameters, after that reduction wrote them."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["defer"]

_DEFERRED: weakref.WeakSet[Any] = weakref.WeakSet()  # sync states whose window waits for the optimizer's step
_HOOK: list[Any] = []


def defer(state: Any) -> None:
    """Close ``state``'s window (``state.close_window()``) at the next ``optimizer.step()`` over one of its
    parameters (``state.registered``). A global optimizer pre-step hook, registered once: the library does not see
    the user's optimizer; it costs a set lookup per step while no window waits."""
    _DEFERRED.add(state)
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_close_deferred))


def _close_deferred(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _DEFERRED:
        return
    order = {id(p): k for k, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    # Each close is a collective: every rank closes its states in the optimizer's parameter order, not the set's.
    due = []
    for state in list(_DEFERRED):
        first = min((order[id(p)] for p in state.registered if id(p) in order), default=None)
        if first is not None:
            due.append((first, state))
    for _, state in sorted(due, key=lambda d: d[0]):
        _DEFERRED.discard(state)
        state.close_window()
