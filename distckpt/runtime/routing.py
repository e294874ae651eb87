"""Routing replay: a checkpointed block's recompute uses the routing decisions its forward made (the outputs of
``topk``, ``sort``/``argsort``, ``argmax``/``argmin``, ``max``/``min`` over a dim and ``multinomial``) instead of
deciding again, so a mixture-of-experts layer sends every token to the same experts in both runs (issue 34).

Without it, a recompute whose router scores move by a rounding error (non-deterministic GPU kernels, bf16 ties,
tied router rows, router noise from a generator that RNG preservation does not restore) can pick other experts:
wrong gradients with no error, or torch's ``CheckpointError``. Eagerly, a dispatch mode under the block's own
checkpoint contexts records those ops' outputs in the forward (cloned: Mixtral divides the top-k values in place)
and hands them back, in call order, to the recompute; under ``torch.compile`` the same ops are marked must-save in
the checkpoint's op policy, so the compiled backward reads them instead of recomputing them. What is kept is only
what these ops return (indices and their values): for a top-2 router, 24 bytes per token and layer (56 with
Mixtral's grouped experts, which also sort the expert ids).

A block's first checkpointed forward tells whether it runs any routing op; one that runs none is not watched
after it (a dispatch mode costs about 10 us per op on the host).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from distckpt import _torch_compat as compat

__all__ = [
    "ROUTING_OPS",
    "ROUTING_PACKETS",
    "replay_contexts",
    "replay_wrapped",
    "replaying",
    "replays",
    "routes",
    "routing_replay_disabled",
    "Stacked",
]

aten = torch.ops.aten

# The ops whose outputs decide routing (argsort dispatches as sort). max/min only over a dim: the full
# reductions return a value, not an index.
ROUTING_OPS = frozenset(
    {
        aten.topk.default,
        aten.sort.default,
        aten.sort.stable,
        aten.argmax.default,
        aten.argmin.default,
        aten.max.dim,
        aten.min.dim,
        aten.multinomial.default,
    }
)
# The same as op packets, for the op-level policy that marks them must-save under torch.compile.
ROUTING_PACKETS = frozenset(op.overloadpacket for op in ROUTING_OPS)

# A block's attribute: whether its forward runs routing ops (absent: not known yet).
_ROUTES = "_distckpt_routes"


def routes(block: nn.Module) -> bool | None:
    """Whether ``block``'s checkpointed forwards run routing ops (``None``: none has run yet)."""
    return block.__dict__.get(_ROUTES)


def replays(block: nn.Module) -> bool:
    """Whether a checkpointed forward of ``block`` run now would record its routing (eagerly) for its recompute."""
    return not getattr(block, "_distckpt_replay_off", 0) and routes(block) is not False


@contextlib.contextmanager
def routing_replay_disabled(model: nn.Module) -> Iterator[None]:
    """Checkpointed blocks of ``model`` whose forward runs inside this context decide their routing again in the
    recompute, as plain ``torch.utils.checkpoint`` does: to check with :func:`distckpt.verify_recompute` whether a
    model's routing is deterministic (it reports ``[routing]`` where it is not), or to measure what replay costs.

    Args:
        model: the model (under DDP/FSDP too); its blocks checkpointed inside the context (a budget's sample
            steps) are covered as well.
    """
    mods = list(model.modules())  # every module: a block a budget checkpoints inside the context too
    for m in mods:
        m._distckpt_replay_off = getattr(m, "_distckpt_replay_off", 0) + 1
    try:
        yield
    finally:
        for m in mods:
            m._distckpt_replay_off -= 1


def _key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What must be equal for a recorded output to stand for a call: shapes, dtypes and devices of the tensor
    arguments and every other argument (k, dim, largest, ...)."""
    leaves, _ = compat.tree_flatten((args, kwargs))
    return tuple((tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else x for x in leaves)


def _clone(out: Any) -> Any:
    return compat.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)


@functools.cache
def _modes() -> tuple[type, type]:
    """The recording and the replaying dispatch mode (classes made once: ``TorchDispatchMode`` is reached
    through the compat module, so they cannot be made at import)."""
    base = compat.torch_dispatch_mode()

    class Record(base):  # type: ignore[misc, valid-type]
        def __init__(self, log: list[Any], block: nn.Module | None) -> None:
            super().__init__()
            self.log, self.block = log, block

        def __enter__(self) -> Any:
            self.log.clear()  # a forward records afresh
            return super().__enter__()

        def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Any:
            done = super().__exit__(exc_type, exc, tb)
            if exc_type is None and self.block is not None and routes(self.block) is not True:
                self.block.__dict__[_ROUTES] = bool(self.log)
            return done

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func in ROUTING_OPS:
                self.log.append((func, _key(args, kwargs), _clone(out)))
            return out

    class Replay(base):  # type: ignore[misc, valid-type]
        def __init__(self, log: list[Any]) -> None:
            super().__init__()
            self.log, self.next = log, 0

        def __enter__(self) -> Any:
            self.next = 0  # every recompute of the forward (a retained graph's second backward) from the start
            return super().__enter__()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func in ROUTING_OPS and self.next < len(self.log):
                op, key, out = self.log[self.next]
                self.next += 1
                if op is func and key == _key(args, kwargs):
                    return _clone(out)
                # The recompute ran other routing ops than its forward (other control flow): replay stops, and
                # torch's own check of the recomputed tensors (or verify_recompute) sees the difference.
                self.next = len(self.log)
            return func(*args, **kwargs)

    return Record, Replay


def replay_contexts(block: nn.Module | None = None) -> tuple[Any, Any]:
    """A fresh ``(forward, recompute)`` context pair for one checkpointed call: the first records the routing ops'
    outputs (and, given ``block``, whether it routes), the second hands them back in call order."""
    log: list[Any] = []
    record, replay = _modes()
    return record(log, block), replay(log)


def replay_wrapped(context_fn: Callable[[], tuple[Any, Any]], block: nn.Module) -> Callable[[], tuple[Any, Any]]:
    """``context_fn`` for checkpointing ``block`` with routing replay under its own contexts (entered first, so
    that op-level policies, ``verify_recompute``'s recorder and MemTracker see the replayed outputs), when the
    block routes or is not known yet; ``context_fn`` itself when replay is off or the block runs no routing op."""
    if not replays(block):
        return context_fn

    def pair() -> tuple[Any, Any]:
        fwd, rec = context_fn()
        mine_fwd, mine_rec = replay_contexts(block)
        return Stacked(mine_fwd, fwd), Stacked(mine_rec, rec)

    return pair


class Stacked:
    """``first`` then ``then``, entered again at every recompute of one forward (a generator context could not)."""

    def __init__(self, first: Any, then: Any) -> None:
        self.contexts = (first, then)
        self.stack: contextlib.ExitStack | None = None

    def __enter__(self) -> None:
        with contextlib.ExitStack() as stack:
            for c in self.contexts:
                stack.enter_context(c)
            self.stack = stack.pop_all()

    def __exit__(self, *exc: Any) -> Any:
        stack, self.stack = self.stack, None
        return stack.__exit__(*exc) if stack is not None else False


def replaying(fn: Callable[..., Any], block: nn.Module) -> Callable[..., Any]:
    """``fn`` for one reentrant checkpoint of ``block`` (which takes no ``context_fn``): its first call (the forward)
    records the routing ops' outputs, every later one (the recompute in backward) replays them."""
    if not replays(block):
        return fn
    fwd, rec = replay_contexts(block)
    calls = [0]

    def run(*args: Any) -> Any:
        ctx = rec if calls[0] else fwd
        calls[0] += 1
        with ctx:
            return fn(*args)

    return run
