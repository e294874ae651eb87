"""Op-level (selective) activation checkpointing: inside each checkpointed block, keep the outputs of
expensive ops (matmuls, attention, convolutions) and recompute the cheap pointwise ones, through
PyTorch's ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.

Two op-level modes have names (a budget chooses among them per block, besides none and full):
``"selective"`` (torchtitan's: keep those outputs but recompute every other matmul) and
``"pointwise"`` (keep every matmul/attention/conv output: the recompute re-runs only the ops that
``FlopCounterMode`` counts no FLOPs for, the pointwise ops, norms and softmax, as torch.compile's
min-cut partitioner does at ``activation_memory_budget=1``). A third, ``"ops"`` (:class:`KeepOps`), keeps
the outputs of exactly the op calls it names (``("aten.addmm.default", 0)``: the block's first ``addmm``)
and recomputes everything else: the per-op choice a budget makes inside a block.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts, noop_context_fn

from distckpt import _torch_compat as compat
from distckpt.errors import ConfigError
from distckpt.runtime.routing import ROUTING_PACKETS, Stacked, replay_contexts, replays

__all__ = [
    "DEFAULT_SAVE_OPS",
    "KEEP_MODE",
    "MATMUL_OPS",
    "OP_MODES",
    "KeepOps",
    "bind",
    "context_mode",
    "keep_context_fn",
    "kept_calls",
    "mode_context_fn",
    "resolve_ops",
    "selective_context_fn",
    "share_reach",
]

aten = torch.ops.aten

# Matmuls whose outputs count for "recompute every other matmul" (see selective_context_fn).
MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm")

# Ops whose outputs are kept by default: matmuls, every scaled_dot_product_attention kernel, and
# convolutions. Names (not OpOverloads) so that a kernel this build of torch lacks is just skipped.
DEFAULT_SAVE_OPS = (
    *MATMUL_OPS,
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "convolution",
    "_scaled_mm",
)


def _packet(op: Any) -> Any:
    overload, packet = compat.op_overload_types()
    if isinstance(op, overload):
        return op.overloadpacket
    if isinstance(op, packet):
        return op
    if isinstance(op, str):
        name = op.removeprefix("torch.ops.").removeprefix("aten.").removeprefix("aten::")
        return getattr(aten, name.split(".")[0], None)
    raise ConfigError(
        f"selective save_ops takes aten ops (torch.ops.aten.mm) or their names ('mm', 'aten.addmm'); got {op!r}."
    )


def resolve_ops(ops: Iterable[Any]) -> frozenset[Any]:
    """Turn op names / ``OpOverload``s / ``OpOverloadPacket``s into a set of overload packets.

    Names this build of torch does not have are skipped (attention kernels differ by version).

    Raises:
        ConfigError: an entry that is not an op or a name.
    """
    return frozenset(p for p in (_packet(op) for op in ops) if p is not None)


class _Reach:
    """How far a block's recompute gets, learned from its recomputes: for each kept op, how many of
    its calls the recompute re-ran (``None`` until one has run).

    Non-reentrant checkpoint stops its recompute as soon as backward has every tensor it saved
    (early stop), so an output kept for an op beyond that point is never read: in a transformer
    block, the MLP's output projection (its output only feeds the residual add). Once learned, a
    forward keeps only what the recompute reads: the same recompute, less memory. Learned as the
    most any recompute re-ran, so a call whose recompute reaches further re-runs those ops once
    (correct, a little more FLOPs) and widens the reach. Kept on the block (:func:`bind`), so that
    what a budget's profile learned holds from the first training step.
    """

    def __init__(self) -> None:
        self.calls: dict[str, int] | None = None  # op name ("aten.mm.default"): picklable

    def kept(self, op: Any, index: int) -> bool:
        """Whether the ``index``-th call of ``op`` in a forward is read by the recompute."""
        return self.calls is None or index < self.calls.get(str(op), 0)

    def learn(self, seen: collections.Counter) -> None:
        """Widen the reach to what one recompute re-ran (``{op name: calls}``)."""
        calls = {} if self.calls is None else self.calls
        for op, n in seen.items():
            calls[op] = max(calls.get(op, 0), n)
        self.calls = calls


def _policy(save: frozenset[Any], every_other_matmul: bool, reach: _Reach | None) -> Callable[..., CheckpointPolicy]:
    # Per forward: calls of each kept op (the recompute counts the same way), matmuls for the parity.
    calls: collections.Counter = collections.Counter()
    matmuls = resolve_ops(MATMUL_OPS)
    count = [0]

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        packet = op.overloadpacket
        if packet not in save:
            return CheckpointPolicy.PREFER_RECOMPUTE
        index = calls[op]
        calls[op] += 1
        if every_other_matmul and packet in matmuls:
            count[0] += 1
            if count[0] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        if reach is not None and not reach.kept(op, index):
            return CheckpointPolicy.PREFER_RECOMPUTE  # beyond the recompute's reach: never read, never re-run
        return CheckpointPolicy.MUST_SAVE

    return policy


@functools.cache
def _counting_mode() -> type:
    """The recompute's counting dispatch mode (:func:`_reach_mode`), a class made once: torch's
    ``TorchDispatchMode`` is reached through the compat module, so the class cannot be made at import."""
    stop = compat.stop_recomputation_error()

    class Counting(compat.torch_dispatch_mode()):  # type: ignore[misc]
        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return True  # as torch's own SAC modes: compiled code is not counted op by op

        def __init__(self, inner: Any, reach: _Reach, save: frozenset[Any]) -> None:
            super().__init__()
            self.inner, self.reach, self.save = inner, reach, save
            self.seen: collections.Counter = collections.Counter()

        def __enter__(self) -> Any:
            self.inner.__enter__()
            return super().__enter__()

        def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Any:
            try:
                super().__exit__(exc_type, exc, tb)
            finally:
                done = self.inner.__exit__(exc_type, exc, tb)
            if exc_type is None or issubclass(exc_type, stop):
                self.reach.learn(self.seen)
            return done

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func.overloadpacket in self.save:
                self.seen[str(func)] += 1
            return func(*args, **(kwargs or {}))

    return Counting


def _reach_mode(inner: Any, reach: _Reach, save: frozenset[Any]) -> Any:
    """The recompute context: torch's (``inner``) under a dispatch mode that counts the kept ops the
    recompute re-runs, then teaches ``reach`` on a completed recompute (or an early stop)."""
    return _counting_mode()(inner, reach, save)


def _contexts(
    save: frozenset[Any], every_other_matmul: bool, reach: _Reach | None = None, replay: bool = False
) -> tuple[Any, Any]:
    if replay:  # made by bind under torch.compile
        if torch.compiler.is_compiling():  # AOT autograd traces the checkpoint: the routing ops become must-save
            save = save | ROUTING_PACKETS
        else:
            # Dynamo could not trace the checkpoint (a graph break inside it) and runs it eagerly: torch's
            # must-save would fail on Mixtral's in-place division of its top-k values ("Tensor cached during
            # selective activation checkpoint has been mutated"), so the eager replay runs under the op policy.
            fwd, rec = _contexts(save, every_other_matmul) if save else (contextlib.nullcontext(),) * 2
            mine_fwd, mine_rec = replay_contexts()
            return Stacked(mine_fwd, fwd), Stacked(mine_rec, rec)
    fwd, rec = create_selective_checkpoint_contexts(_policy(save, every_other_matmul, reach))
    return fwd, (rec if reach is None else _reach_mode(rec, reach, save))


# The block attribute holding the reach of each op-level policy it ran under:
# {(save ops, every_other_matmul): _Reach}; a copy of the block (deepcopy, pickle) keeps what it learned.
_REACH = "_distckpt_reach"


def share_reach(source: Any, target: Any) -> None:
    """Widen ``target``'s reach to what ``source``'s recomputes were seen to read: a block the plan's
    estimator did not trace, given a traced block of the same shape (one reach per op-level policy).
    Widening is always safe: a reach wider than the block's own only keeps an output it never reads."""
    for key, reach in source.__dict__.get(_REACH, {}).items():
        if reach.calls is not None:
            target.__dict__.setdefault(_REACH, {}).setdefault(key, _Reach()).learn(collections.Counter(reach.calls))


def bind(context_fn: Callable[[], tuple[Any, Any]] | None, block: Any) -> Callable[[], tuple[Any, Any]]:
    """``context_fn`` for checkpointing ``block``: one of distckpt's op-level policies gets the
    block's own :class:`_Reach` (what its recompute reads), any other is returned as it is, and
    ``None`` (full recompute) is torch's ``noop_context_fn``."""
    compiling = torch.compiler.is_compiling()
    # Routing replay under torch.compile (eagerly: distckpt.runtime.routing's dispatch modes, added by the
    # checkpoint's caller): the routing ops' outputs are must-save (see _contexts), so the compiled backward reads
    # the forward's decisions instead of deciding again.
    replay = compiling and replays(block)  # a block an eager forward showed to be dense: torch's plain compiled AC
    if context_fn is None:
        return functools.partial(_contexts, frozenset(), False, None, True) if replay else noop_context_fn
    if isinstance(context_fn, functools.partial) and context_fn.func is _keep_contexts:
        # The "ops" mode has no reach (it keeps named calls only): under compile, routing replay's must-save.
        return functools.partial(_keep_contexts, context_fn.args[0], True) if replay else context_fn
    if not (isinstance(context_fn, functools.partial) and context_fn.func is _contexts):
        return context_fn
    if compiling:
        # Under torch.compile the partitioner saves only what backward reads, so the reach has no job there;
        # and dynamo takes a context_fn only as a constant: a _Reach in it broke the graph and ran the whole
        # checkpoint eagerly (measured, torch 2.13).
        return functools.partial(_contexts, *context_fn.args[:2], None, replay)
    save, every_other = context_fn.args[:2]
    key = (tuple(sorted(str(p) for p in save)), every_other)
    reach = block.__dict__.setdefault(_REACH, {}).setdefault(key, _Reach())
    return functools.partial(_contexts, save, every_other, reach)


def selective_context_fn(save_ops: Any = None, every_other_matmul: bool = True) -> Callable[[], tuple[Any, Any]]:
    """The ``context_fn`` for ``torch.utils.checkpoint`` that saves the outputs of ``save_ops``.

    Every other op is recomputed in backward. With ``every_other_matmul`` (the default, as
    torchtitan's selective AC does), the 2nd, 4th, ... matmul of each block is recomputed too: in a
    transformer block those are the attention and MLP output projections, whose outputs only feed
    the residual add, so keeping them would cost memory and recomputing them costs little (the
    last one is not even re-run: non-reentrant checkpoint stops once backward has what it needs).

    Args:
        save_ops: ops whose outputs are kept, as aten ops or names (default :data:`DEFAULT_SAVE_OPS`).
        every_other_matmul: recompute every second matmul of a block instead of keeping it.

    Returns:
        A zero-argument callable returning a fresh ``(forward, recompute)`` context pair.

    Raises:
        ConfigError: when ``save_ops`` holds something that is not an op.
    """
    save = resolve_ops(DEFAULT_SAVE_OPS if save_ops is None else save_ops)
    return functools.partial(_contexts, save, every_other_matmul)


# The named op-level checkpoint modes, in order of decreasing recompute (and increasing memory).
OP_MODES = ("selective", "pointwise")


def mode_context_fn(mode: str) -> Callable[[], tuple[Any, Any]]:
    """The ``context_fn`` of a named op-level mode: ``"selective"`` (recompute every other matmul
    too) or ``"pointwise"`` (keep every matmul, recompute only the FLOP-free ops).

    Raises:
        ConfigError: a mode not in :data:`OP_MODES`.
    """
    if mode not in OP_MODES:
        raise ConfigError(f"op-level checkpoint mode must be one of {OP_MODES}, got {mode!r}.")
    return selective_context_fn(every_other_matmul=mode == "selective")


# The per-op mode's name (KeepOps): a block keeps the outputs of the op calls named, nothing else.
KEEP_MODE = "ops"


@dataclass(frozen=True)
class KeepOps:
    """The ``"ops"`` checkpoint mode of one block: keep the outputs of exactly these op calls, recompute
    every other op in backward (the op-level choice a budget makes per block, or placed by hand with
    :class:`~distckpt.select.Placement`).

    Attributes:
        calls: ``(op, index)`` pairs: ``op`` an aten overload's name as ``str(op)`` gives it
            (``"aten.addmm.default"``), ``index`` which of that op's calls in one forward of the block
            (0: the first). A block's forward runs its ops in the same order every time, and its
            recompute runs them again in that order, so a call is found by its place.
    """

    calls: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        ok = all(
            isinstance(c, tuple) and len(c) == 2 and isinstance(c[0], str) and isinstance(c[1], int) and c[1] >= 0
            for c in self.calls
        )
        if not ok:
            raise ConfigError(
                f"KeepOps(calls=...) takes (op name, call index) pairs such as ('aten.addmm.default', 0), got "
                f"{self.calls!r}."
            )
        object.__setattr__(self, "calls", tuple(sorted(set(self.calls))))

    def __str__(self) -> str:
        return KEEP_MODE


def _keep_policy(calls: frozenset[tuple[str, int]], routing: bool = False) -> Callable[..., CheckpointPolicy]:
    seen: collections.Counter = collections.Counter()  # per forward: calls of each op so far

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if routing and op.overloadpacket in ROUTING_PACKETS:
            return CheckpointPolicy.MUST_SAVE  # routing replay under torch.compile (see bind)
        name = str(op)
        index = seen[name]
        seen[name] += 1
        return CheckpointPolicy.MUST_SAVE if (name, index) in calls else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _keep_contexts(calls: frozenset[tuple[str, int]], replay: bool = False) -> tuple[Any, Any]:
    # torch 2.13 asks the policy in the forward only (the recompute takes what the forward stored), so one
    # call counter per forward is the whole state. ``replay`` (made by bind under torch.compile) as in _contexts:
    # traced, the routing ops are must-save; run eagerly after a graph break, replay's own dispatch modes.
    if replay and not torch.compiler.is_compiling():
        mine_fwd, mine_rec = replay_contexts()
        fwd, rec = create_selective_checkpoint_contexts(_keep_policy(calls))
        return Stacked(mine_fwd, fwd), Stacked(mine_rec, rec)
    return create_selective_checkpoint_contexts(_keep_policy(calls, routing=replay))


def keep_context_fn(keep: KeepOps) -> Callable[[], tuple[Any, Any]]:
    """The ``context_fn`` of the ``"ops"`` mode: keep the outputs of ``keep.calls``, recompute the rest."""
    return functools.partial(_keep_contexts, frozenset(keep.calls))


def kept_calls(context_fn: Callable[[], tuple[Any, Any]]) -> KeepOps | None:
    """The :class:`KeepOps` a ``context_fn`` of :func:`keep_context_fn` keeps, else ``None``."""
    if isinstance(context_fn, functools.partial) and context_fn.func is _keep_contexts:
        return KeepOps(tuple(context_fn.args[0]))
    return None


def context_mode(context_fn: Callable[[], tuple[Any, Any]]) -> str:
    """The named mode a ``context_fn`` runs: ``"pointwise"`` for the default saved ops without
    every-other-matmul recompute, ``"ops"`` for :func:`keep_context_fn`'s, else ``"selective"`` (any other
    op-level policy, user-made too)."""
    if kept_calls(context_fn) is not None:
        return KEEP_MODE
    if isinstance(context_fn, functools.partial) and context_fn.func is _contexts:
        save, every_other = context_fn.args[:2]  # a block's bound one carries its reach third
        if not every_other and save == resolve_ops(DEFAULT_SAVE_OPS):
            return "pointwise"
    return "selective"
