"""Reduction windows that close at the optimizer's step: ``torch.distributed.pipelining`` turns FSDP2's gradient sync
off for every micro-batch's backward and reduces them all after the schedule, outside autograd
(``perform_reduce_grad``), so no backward of the step can end the window. The sync state
(:mod:`distckpt.parallel.param_sync`) then closes it (the used bits all-reduced, the gradients of parameters no rank
used reset to None) right before ``optimizer.step()`` over its parameters, after that reduction wrote them. Without
it, a head no rank used kept FSDP2's zero gradient and AdamW decayed it (measured, tests/distributed/
test_pipelining.py)."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from distckpt import _torch_compat as compat
from distckpt.options import Engine

__all__ = ["deferred"]

_DEFERRED: weakref.WeakSet[Any] = weakref.WeakSet()  # sync states whose window waits for the optimizer's step
_HOOK: list[Any] = []


def deferred(state: Any) -> bool:
    """Whether the backward that starts now leaves ``state``'s window to the optimizer's step: FSDP2 with its own
    gradient sync off while ``distckpt.accumulate`` is not (``state.sync``; pipelining's schedules). Then the window
    is registered to close at the next ``optimizer.step()`` over one of ``state.registered`` (a global optimizer
    pre-step hook, registered once: the library does not see the user's optimizer; a set lookup per step while no
    window waits)."""
    if state.engine is not Engine.FSDP2 or compat.fsdp2_reduces_grads(u.module for u in state.units):
        return False
    _DEFERRED.add(state)
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_close_deferred))
    return True


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
        # A window a later backward closed already (FSDP2's sync back on: _none_at_start reset) is not closed twice:
        # an empty window would reset every gradient to None.
        if state._none_at_start is not None:
            state._end_of_backward(True)  # a pass that reduces, with nothing of its own: the window's end
