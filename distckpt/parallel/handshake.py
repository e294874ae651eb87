"""The phases of a parallel model (each forward, each backward through it, the end-of-step reduction), for the two
guards against a hang: the handshake, and the feed of the hang watchdog (:mod:`distckpt.parallel.watchdog`).

Why a handshake: under FSDP/FSDP2/HSDP every forward all-gathers the parameters with every rank, and under DDP with
per-forward buffer sync every forward broadcasts the buffers. A forward that some ranks run alone (a second task's
forward on some ranks, evaluation on rank 0 only) pairs those collectives with another rank's backward: a hang, or
collectives of one size paired silently (the root's all-gather in a forward with the root's all-gather in a
backward). The other ranks cannot replay a forward they have no batch for, so it is refused: at the start of every
forward of the model and of every backward through it, before the strategy's own first collective there, the ranks
all-reduce (phase, step, forwards and backwards so far in the step, grad mode), 10 integers on a CPU group. On a
mismatch every rank raises the same ConfigError at that handshake, naming each rank's phase, and nothing is left
pending. DDP without per-forward buffer sync is exact with any forwards per rank: no handshake, no collective added.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from distckpt import _torch_compat as compat
from distckpt.errors import ConfigError
from distckpt.parallel.watchdog import process_watchdog

__all__ = ["Handshake", "Phases", "cpu_group", "guard_hangs", "watched"]

FORWARD, BACKWARD = 1, 2

_CPU_GROUPS: dict[Any, Any] = {}


def cpu_group(group: Any) -> Any:
    """``group`` itself when it runs on gloo, else a gloo group over the same ranks, made once per group (a
    collective call: every rank of the job runs it, as it runs ``parallelize``). The handshake's integers then
    never wait for, or synchronize, a GPU stream."""
    if "gloo" in str(dist.get_backend(group)):
        return group
    key = group if group is not None else dist.group.WORLD
    if key not in _CPU_GROUPS:
        _CPU_GROUPS[key] = dist.new_group(ranks=dist.get_process_group_ranks(key), backend="gloo")
    return _CPU_GROUPS[key]


class Handshake:
    """One all-reduce of 10 integers per phase; on a mismatch, one all-gather to name each rank's phase.

    Args:
        group: the ranks whose collectives must pair (the model's data-parallel group), on gloo (:func:`cpu_group`).
        why: one sentence: which collectives a lone forward would pair with what, for this strategy.
        fix: one sentence: what to change.
    """

    def __init__(self, group: Any, why: str, fix: str):
        self.group = group
        self.why, self.fix = why, fix

    def meet(self, phase: int, step: int, forwards: int, backwards: int, grad: bool) -> None:
        """Raises:
        ConfigError: on every rank alike, when the ranks are not all at the same phase of the same step."""
        mine = torch.tensor([phase, step, forwards, backwards, int(grad)], dtype=torch.int64)
        both = torch.cat([mine, -mine])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        if torch.equal(both[:5], -both[5:]):
            return
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(everyone, mine, group=self.group)
        raise ConfigError(self.message([t.tolist() for t in everyone]))

    def message(self, states: list[list[int]]) -> str:
        """The error every rank raises: each group of ranks in one state, the reason and the fix."""
        by_state: dict[tuple[int, ...], list[int]] = {}
        for rank, state in enumerate(states):
            by_state.setdefault(tuple(state), []).append(dist.get_global_rank(self.group, rank) if self.group else rank)
        parts = [f"{_ranks(ranks)} {_describe(state)}" for state, ranks in sorted(by_state.items(), key=lambda x: x[1])]
        step = min(s[1] for s in states)
        return (
            f"the ranks ran different forwards of the model in step {step}: {'; '.join(parts)}. {self.why} {self.fix}"
        )


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _describe(state: tuple[int, ...]) -> str:
    phase, step, forwards, backwards, grad = state
    if phase == FORWARD:
        return f"began forward {forwards} of step {step}" + ("" if grad else " without gradients (evaluation)")
    plural = "" if forwards == 1 else "s"
    return f"began backward {backwards} of step {step}, after {forwards} forward{plural}"


class Phases:
    """Hooks that tell which phase the model is in: each forward (a pre-hook on the parallel model, before the
    strategy's own), each backward (a hook on the root's outputs, before FSDP's pre-backward hook: registered by the
    sync state's join, see :meth:`watch_backward`), each unit (the watchdog's progress) and the end-of-step reduction.

    Args:
        state: the model's ``SyncState`` (its ``step`` counts the reductions so far).
        handshake: the handshake, where one is needed (None: DDP without per-forward buffer sync).
        watchdog: the process's hang watchdog (None: ``hang_timeout=None``).
        limit: the model's ``hang_timeout`` in seconds.
    """

    def __init__(self, state: Any, handshake: Handshake | None, watchdog: Any, limit: float):
        self.state = state
        self.handshake = handshake
        self.watchdog = watchdog
        self.limit = limit
        self.forwards = self.backwards = 0  # in the current step
        self._step = 0
        self._task: int | None = None  # the autograd pass whose backward began last

    def install(self, wrapped: nn.Module, units: list[tuple[str, nn.Module]]) -> None:
        """Register the hooks (kept in the state's handles) and hand the state its ``phases``."""
        handles = self.state.handles
        # prepend=True, registered after fully_shard: before FSDP2's pre-forward all-gather (FSDP1's and DDP's run
        # inside their wrapper's forward, after any pre-hook).
        handles.append(wrapped.register_forward_pre_hook(lambda m, a: self._forward(), prepend=True))
        if self.watchdog is not None:
            handles.append(wrapped.register_forward_hook(lambda m, a, o: self._left(), always_call=True))
            for name, unit in units:
                handles.append(unit.register_forward_pre_hook(lambda m, a, n=name: self._progress(n)))
        self.state.phases = self
        self.state.on_reduce.insert(0, self._reducing)  # the label first: the running statistics' sync is in it

    def _left(self) -> None:
        if self.watchdog is not None:
            self.watchdog.leave()

    def _progress(self, unit: str) -> None:
        if self.watchdog is not None:
            self.watchdog.progress(unit)

    def _new_step(self) -> int:
        step = self.state.step
        if step != self._step:
            self._step, self.forwards, self.backwards = step, 0, 0
        return step

    def _forward(self) -> None:
        step = self._new_step()
        self.forwards += 1
        if self.watchdog is not None:
            # Lives in the frame that runs the module's hooks and forward (the hook's caller's caller: a lambda).
            self.watchdog.enter(f"forward {self.forwards} of step {step}", self.limit, _frame_id(2))
        if self.handshake is not None:
            self._meet(FORWARD, step)

    def watch_backward(self, outputs: list[torch.Tensor]) -> None:
        """Called by the sync state's join on the root's outputs, before FSDP's post-forward hook registers its
        pre-backward hook on them: a tensor hook registered first runs first, before FSDP's all-gather."""
        if self.handshake is None and self.watchdog is None:
            return
        for t in outputs:
            t.register_hook(self._backward)

    def _backward(self, grad: torch.Tensor) -> None:
        task = compat.current_graph_task_id()
        if task == self._task:  # once per pass, at the first root output it reaches
            return
        self._task = task
        step = self._new_step()
        self.backwards += 1
        if self.watchdog is not None:
            # Lives in the frame that called the autograd engine (none on a CUDA backward's own thread).
            self.watchdog.enter(f"backward {self.backwards} of step {step}", self.limit, _frame_id(1))
            # Behind the callbacks queued in this pass and those they queue (DDP's finalize, the end-of-step
            # reduction): the pass is over when this runs.
            compat.queue_after_backward(lambda: compat.queue_after_backward(self._left))
        if self.handshake is not None:
            self._meet(BACKWARD, step)

    def _meet(self, phase: int, step: int) -> None:
        try:
            self.handshake.meet(
                phase, step, self.forwards, self.backwards, torch.is_grad_enabled() or phase == BACKWARD
            )
        except ConfigError:
            if self.watchdog is not None:
                self.watchdog.leave()  # refused alike on every rank: nothing left to watch
            raise

    def _reducing(self) -> None:
        if self.watchdog is not None:
            self.watchdog.relabel(f"the end-of-step reduction of step {self.state.step - 1}")


# What a lone forward pairs with, and the fix, by strategy (the handshake's message).
_SHARDED_WHY = (
    "Under {name} every forward all-gathers the parameters with every rank, so a forward that some ranks run alone "
    "pairs its collectives with another rank's backward (a hang, or silently wrong values)."
)
_SHARDED_FIX = (
    "Run every forward of the model on every rank (the extra task's forward on every rank, with an empty batch or its "
    "loss weighted zero; evaluation on every rank), or use strategy='ddp', which allows different forwards per rank."
)
_DDP_WHY = (
    "DDP with forward_sync_buffers=True (or broadcast_buffers=True) broadcasts the buffers from rank 0 at every "
    "forward, so a forward that some ranks run alone has no partner (a hang)."
)
_DDP_FIX = (
    "Run every forward on every rank, or drop forward_sync_buffers/broadcast_buffers: distckpt then syncs running "
    "statistics once per step, and any forwards per rank are exact."
)


def guard_hangs(
    wrapped: nn.Module,
    state: Any,
    units: list[tuple[str, nn.Module]],
    *,
    name: str,
    forward_collectives: bool,
    hang_timeout: float | None,
) -> None:
    """Give a parallel model its handshake (where its forwards run collectives: FSDP, FSDP2, HSDP, DDP syncing
    buffers at every forward) and its watchdog feed (``hang_timeout`` seconds; None or 0: off).

    Args:
        wrapped: the parallel model (DDP/FSDP wrapper, or the FSDP2 root).
        state: its ``SyncState``.
        units: (name, module) of each module whose forward is one unit (FSDP's blocks): the watchdog's progress.
        name: the strategy as the user named it, for messages.
        forward_collectives: whether each forward runs collectives of the strategy's own.
        hang_timeout: seconds, see :mod:`distckpt.parallel.watchdog`.
    """
    handshake = None
    if forward_collectives:
        why, fix = (_DDP_WHY, _DDP_FIX) if name == "ddp" else (_SHARDED_WHY.format(name=name), _SHARDED_FIX)
        handshake = Handshake(cpu_group(state.group), why, fix)
    watchdog = process_watchdog(hang_timeout) if hang_timeout else None
    if handshake is not None or watchdog is not None:
        Phases(state, handshake, watchdog, hang_timeout or 0.0).install(wrapped, units)


@contextlib.contextmanager
def watched(state: Any, what: str) -> Iterator[None]:
    """Inside: a phase of the model whose sync ``state`` is given (None: nothing), for the hang watchdog: ``what``
    (a guard check's collectives) is watched as its forward and backward are."""
    phases = getattr(state, "phases", None)
    watchdog = getattr(phases, "watchdog", None)
    if watchdog is None:
        yield
        return
    watchdog.enter(what, phases.limit, _frame_id(2))  # the frame of the ``with`` (above contextlib's __enter__)
    try:
        yield
    finally:
        watchdog.leave()


def _frame_id(depth: int) -> int | None:
    """The id of the frame ``depth`` levels above the caller, or None when the stack is not that deep."""
    try:
        return id(sys._getframe(depth + 1))  # noqa: SLF001 - CPython's frame access, as the traceback module's
    except ValueError:
        return None
