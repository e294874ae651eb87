"""The op-by-op half of :func:`distckpt.verify_recompute`: a dispatch-mode recorder that logs every op of each
checkpointed block's forward and of its recompute (outputs as sums, integer outputs element by element), and the
comparison that names the first module whose recompute differs and the likely cause, a routing decision first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from distckpt import _torch_compat as compat
from distckpt.runtime.routing import ROUTING_OPS

__all__ = ["CAUSES", "Call", "Mismatch", "op_mismatches", "recording", "storage_of"]

_RANDOM_OPS = (
    "bernoulli",
    "dropout",
    "rand",
    "normal",
    "uniform",
    "multinomial",
    "exponential",
    "cauchy",
    "geometric",
    "log_normal",
    "poisson",
    "random_",
)
_UNINITIALIZED_OPS = ("empty",)  # outputs of empty/empty_like/new_empty hold garbage: never compared
# Autograd detaches the tensors it saves in the recompute but not in the forward, and autocast casts a
# weight once per autocast region (its cache), so the recompute casts where the forward reused a
# cast: neither is a difference (a cast's value follows from its input, which is compared).
_IGNORED_OPS = frozenset({"aten::detach", "aten::alias", "aten::lift_fresh", "aten::_to_copy"})


@dataclass(frozen=True)
class Mismatch:
    """One place where the checkpointed step differs from the step without checkpointing.

    Attributes:
        module: FQN of the module (a submodule of a checkpointed block, the block, or the owner of a
            differing gradient or buffer).
        kind: ``"routing"``, ``"rng"``, ``"control_flow"``, ``"shape"``, ``"state"``, ``"batchnorm"``,
            ``"buffer"``, ``"gradient"``, ``"loss"``, ``"nonfinite"`` or ``"checkpoint_error"``.
        detail: what differs.
        cause: the likely cause and the fix, in words.
    """

    module: str
    kind: str
    detail: str
    cause: str


CAUSES = {
    "routing": "Likely cause: the router's scores differ between forward and recompute by a rounding error (tied "
    "scores, non-deterministic kernels, router noise from a generator that checkpointing does not restore), so "
    "the recompute sends tokens to other experts. Fix: keep distckpt's routing replay on (the default: the "
    "recompute reuses the forward's routing; this step ran inside distckpt.routing_replay_disabled, or its "
    "routing ops were not those of the forward).",
    "rng": "Likely cause: a random op (dropout) is recomputed with another RNG state because the block is "
    "checkpointed with preserve_rng_state=False. Fix: distckpt.wrap(..., preserve_rng_state=True) "
    "(the default).",
    "rng_preserved": "Likely cause: a random op draws from a generator or device whose state checkpointing "
    "does not save. Fix: use the default generator, or leave this block out of checkpointing.",
    "control_flow": "Likely cause: control flow inside the block reads state (a flag or attribute such as a task "
    "switch) that changed between forward and backward. Fix: pass it as a forward argument or "
    "restore it before backward, or leave this block out of checkpointing (wrap's blocks=).",
    "shape": "Likely cause: data-dependent shapes (nonzero, unique, masked_select) or state that changed between "
    "forward and backward. Fix: make the shapes depend only on the block's inputs, or leave this block "
    "out of checkpointing (wrap's blocks=).",
    "state": "Likely cause: the block reads state (an attribute, a global, a buffer or a parameter modified in "
    "place) that changed between forward and backward. Fix: pass it as a forward argument, or leave "
    "this block out of checkpointing (wrap's blocks=).",
    "batchnorm": "Likely cause: BatchNorm running statistics updated a second time by the recompute "
    "(pytorch#96136). Fix: checkpoint with distckpt.wrap (which restores them) rather than a bare "
    "torch.utils.checkpoint, or keep BatchNorm outside checkpointed blocks.",
    "buffer": "Likely cause: the block updates this buffer in its forward, and the recompute updates it again. "
    "Fix: leave this block out of checkpointing, or update the buffer outside it.",
    "gradient": "Likely cause: the recompute of a checkpointed block does not reproduce its forward. Fix: run "
    "verify_recompute with the blocks checkpointed one at a time to find it.",
    "loss": "Likely cause: the forward itself differs when checkpointing is on (a module that behaves "
    "differently under checkpointing). Fix: leave the block out of checkpointing.",
    "nonfinite": "The recompute cannot be verified on non-finite values (nan equals nothing, not even itself). "
    "Fix the model, loss or data first (run loss_fn without checkpointing: "
    "distckpt.checkpointing_disabled), then verify again.",
    "checkpoint_error": "Likely cause: the recompute saved tensors of other shapes or dtypes than the forward "
    "(state or data that changed between forward and backward). Fix: see the message; leave "
    "this block out of checkpointing if it must read such state.",
}


def storage_of(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (``-1`` for a tensor without one): buffers are told apart by it."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (subclasses)
        return -1


_OUTPUT = " output"  # the name of a submodule's output record (reentrant blocks)
# An integer output up to this size is kept whole and compared element by element (a permutation of top-k
# indices has the same sum); a larger one by a position-weighted sum.
_WHOLE = 1 << 20


class _Op(NamedTuple):
    """One op of a forward or a recompute (or a submodule's output, for reentrant blocks)."""

    name: str
    module: str  # the module it ran in; for a routing op, the router (the module whose output it routes on)
    values: list[tuple[Any, ...]]  # per output: (shape, dtype, sum, sum of squares[, integer values])
    routing: bool = False


def _op_record(name: str, module: str, out: Any, state: frozenset[int] = frozenset(), routing: bool = False) -> _Op:
    tensors = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
    values: list[tuple[Any, ...]] = []
    for t in tensors:
        t = t.detach()
        # Buffers updated in place (BatchNorm statistics) legitimately differ in the recompute;
        # whether their final value is right is checked on the buffers themselves.
        if t.is_complex() or t.is_sparse or t.device.type == "meta" or storage_of(t) in state:
            values.append((tuple(t.shape), t.dtype, None, None))
            continue
        t64 = t.double()
        entry: tuple[Any, ...] = (tuple(t.shape), t.dtype, float(t64.sum()), float((t64 * t64).sum()))
        if not (t.is_floating_point() or t.is_complex()):
            if t.numel() <= _WHOLE:
                entry += (t.to("cpu", copy=True),)
            else:
                weights = torch.arange(1, t.numel() + 1, dtype=torch.float64, device=t.device)
                entry += (float((t64.flatten() * weights).sum()),)
        values.append(entry)
    return _Op(name, module, values, routing)


@dataclass
class Call:
    """One checkpointed call of a block: what its forward ran and what its recompute ran."""

    index: int
    block: str
    preserve_rng: bool
    fwd: list[Any] = field(default_factory=list)
    rec: list[Any] = field(default_factory=list)
    stack: list[str] = field(default_factory=list)


def _recorder(log: list[Any], stack: list[str], state: frozenset[int]) -> Any:
    # A TorchDispatchMode (what selective checkpointing itself uses) sees every op with its outputs;
    # it is the only place where the recompute's intermediate values can be observed.
    made_in = compat.weak_id_dict()  # tensor -> the module whose output it derives from (see _source)

    class _Recorder(compat.torch_dispatch_mode()):  # type: ignore[misc]
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            if func.name() in _IGNORED_OPS:
                return out
            source = _source(stack[-1], args, made_in)
            for t in compat.tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    made_in[t] = source
            # A routing op is named after its router: the module that made the scores it routes on.
            routing = func in ROUTING_OPS
            log.append(_op_record(str(func.name()), source if routing else stack[-1], out, state, routing))
            return out

    return _Recorder()


def _source(module: str, args: Any, made_in: Any) -> str:
    """Where an op's output comes from: the module it runs in, or, when it runs in a parent module on the output
    of a submodule (a softmax over ``router(h)``), that submodule: the deepest such input's."""
    best = module
    for t in compat.tree_flatten(args)[0]:
        if isinstance(t, torch.Tensor):
            src = made_in.get(t)
            if src is not None and src.startswith(module + ".") and src.count(".") > best.count("."):
                best = src
    return best


@contextlib.contextmanager
def recording(
    blocks: list[tuple[str, nn.Module]], calls: list[Call], phase: list[str], state: frozenset[int]
) -> Iterator[None]:
    """Record per checkpointed call the ops of its forward and of its recompute.

    Non-reentrant blocks: through their ``context_fn`` (checkpoint enters one context around the
    forward and another around the recompute). Reentrant blocks accept no ``context_fn``: their
    submodules' outputs are recorded with forward hooks, which fire in both passes.
    """
    handles = []
    saved: list[tuple[nn.Module, Any]] = []
    current: dict[int, Call] = {}
    try:
        for bname, block in blocks:
            opts = block._distckpt_options
            saved.append((block, opts))

            def pre(mod: nn.Module, _args: Any, bname: str = bname, opts: Any = opts) -> None:
                if phase[0] == "fwd":
                    call = Call(len(calls), bname, opts.preserve_rng_state, stack=[bname])
                    calls.append(call)
                    current[id(mod)] = call

            handles.append(block.register_forward_pre_hook(pre))
            for sub_name, sub in block.named_modules():
                if sub is block:
                    continue
                full = f"{bname}.{sub_name}"

                def sub_pre(_m: nn.Module, _a: Any, full: str = full, block: nn.Module = block) -> None:
                    call = current.get(id(block))
                    if call is not None:
                        call.stack.append(full)

                def sub_post(
                    _m: nn.Module,
                    _a: Any,
                    out: Any,
                    full: str = full,
                    block: nn.Module = block,
                    reentrant: bool = opts.reentrant,
                ) -> None:
                    call = current.get(id(block))
                    if call is None:
                        return
                    if call.stack and call.stack[-1] == full:
                        call.stack.pop()
                    if reentrant:  # op-level records are not available: record the submodule's output
                        log = call.fwd if phase[0] == "fwd" else call.rec
                        rec = _op_record(f"{type(_m).__name__}{_OUTPUT}", full, out, state)
                        log.append(rec._replace(routing=any(len(v) > 4 for v in rec.values)))

                handles.append(sub.register_forward_pre_hook(sub_pre))
                handles.append(sub.register_forward_hook(sub_post))
            if opts.reentrant:
                continue
            user_fn = opts.context_fn

            def context_fn(block: nn.Module = block, user_fn: Any = user_fn, bname: str = bname) -> tuple[Any, Any]:
                call = current[id(block)]  # context_fn runs in the forward, inside this call
                fwd_user, rec_user = user_fn() if user_fn else (contextlib.nullcontext(), contextlib.nullcontext())

                @contextlib.contextmanager
                def ctx(log: list[Any]) -> Iterator[None]:
                    current[id(block)] = call  # submodule hooks tag ops with this call's module stack
                    call.stack[:] = [bname]  # a recompute stopped early leaves submodules on the stack
                    with fwd_or_rec(log), _recorder(log, call.stack, state):
                        yield

                def fwd_or_rec(log: list[Any]) -> Any:
                    return fwd_user if log is call.fwd else rec_user

                return ctx(call.fwd), ctx(call.rec)

            block._distckpt_options = dataclasses.replace(opts, context_fn=context_fn)
        yield
    finally:
        for h in handles:
            h.remove()
        for block, opts in saved:
            block._distckpt_options = opts


def _values_differ(a: tuple[Any, ...], b: tuple[Any, ...], rtol: float) -> bool:
    if len(a) > 4 and len(b) > 4:  # integer outputs: element by element (or their position-weighted sums)
        x, y = a[4], b[4]
        return not torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x != y
    (_, _, s1, q1), (_, _, s2, q2) = a[:4], b[:4]
    if s1 is None or s2 is None:
        return False
    if not all(math.isfinite(x) for x in (s1, q1, s2, q2)):  # the bounds below are inf > inf: never true
        return not all((math.isnan(x) and math.isnan(y)) or x == y for x, y in ((s1, s2), (q1, q2)))
    # Outputs differing by d (L2) change the sum of squares by at most 2|x||d| and the sum by at
    # most sqrt(n)|d|: both bounds at |d| = rtol * |x|.
    norm = math.sqrt(max(q1, q2, 0.0))
    n = max(1, math.prod(a[0]))
    return abs(q1 - q2) > 2 * rtol * norm * norm + 1e-30 or abs(s1 - s2) > rtol * norm * math.sqrt(n) + 1e-30


def _first_mismatch(call: Call, rtol: float) -> Mismatch | None:
    """The first op (or submodule output) whose recompute differs from its forward; but a routing decision that
    differs further on comes first (what differed before it, router noise or a rounding error, is its cause)."""
    first: Mismatch | None = None
    # Non-reentrant checkpoint stops the recompute once it has what backward needs: compare the prefix.
    for k, (f, r) in enumerate(zip(call.fwd, call.rec)):
        if f.name != r.name or len(f.values) != len(r.values):
            found = Mismatch(
                f.module,
                "control_flow",
                f"op #{k} of the recompute is {r.name}, the forward ran {f.name}",
                CAUSES["control_flow"],
            )
            return first or found  # the ops are no longer aligned: nothing further can be compared
        if any(_UNINITIALIZED in f.name for _UNINITIALIZED in _UNINITIALIZED_OPS):
            continue
        found = _routing_mismatch(k, f, r, rtol, first) or (None if first else _op_mismatch(k, f, r, rtol, call))
        if found is not None and found.kind == "routing":
            return found
        first = first or found
    return first


def _routing_mismatch(k: int, f: _Op, r: _Op, rtol: float, before: Mismatch | None) -> Mismatch | None:
    """A routing op that decided otherwise (for a reentrant block, recorded at its submodules' outputs: the
    integer outputs, indices, of a submodule)."""
    if not f.routing:
        return None
    pairs = list(zip(f.values, r.values))
    if f.name.endswith(_OUTPUT):
        pairs = [(fv, rv) for fv, rv in pairs if len(fv) > 4]
    differs = [(fv, rv) for fv, rv in pairs if fv[:2] != rv[:2] or _values_differ(fv, rv, rtol)]
    if not differs:
        return None
    what = f"{f.name} (op #{k}) decided otherwise in the recompute"
    ints = [(fv, rv) for fv, rv in differs if len(fv) > 4 and isinstance(fv[4], torch.Tensor)]
    if ints and ints[0][0][:2] == ints[0][1][:2] and ints[0][0][4].dim():
        x, y = ints[0][0][4], ints[0][1][4]
        rows = x.reshape(-1, x.shape[-1]) != y.reshape(-1, y.shape[-1])
        what += f": {int(rows.any(-1).sum())} of {rows.shape[0]} rows (tokens) got other indices"
    elif ints:
        what += f": shape {list(ints[0][1][0])} vs {list(ints[0][0][0])} in the forward"
    if before is not None:
        what += f" (upstream, {before.module} [{before.kind}]: {before.detail})"
    return Mismatch(f.module, "routing", what, CAUSES["routing"])


def _op_mismatch(k: int, f: _Op, r: _Op, rtol: float, call: Call) -> Mismatch | None:
    """A difference of shape or value at op ``k``."""
    for fv, rv in zip(f.values, r.values):
        if fv[0] != rv[0] or fv[1] != rv[1]:
            return Mismatch(
                f.module,
                "shape",
                f"{f.name} (op #{k}) gave shape {list(rv[0])} {rv[1]} in the recompute, {list(fv[0])} {fv[1]} in "
                "the forward",
                CAUSES["shape"],
            )
        if _values_differ(fv, rv, rtol):
            random = any(name in f.name.lower() for name in _RANDOM_OPS)
            kind = "rng" if random else "state"
            cause = CAUSES[("rng_preserved" if call.preserve_rng else "rng") if random else "state"]
            return Mismatch(
                f.module,
                kind,
                f"{f.name} (op #{k}) gave other values in the recompute (sum {rv[2]:.6g} vs {fv[2]:.6g} in the "
                "forward)",
                cause,
            )
    return None


def op_mismatches(
    calls: list[Call], blocks: list[tuple[str, nn.Module]], error: Exception | None, rtol: float
) -> list[Mismatch]:
    """Differences inside the checkpointed blocks (first, as they name the op), then torch's CheckpointError."""
    mismatches: list[Mismatch] = []
    if reentrant_calls := [c for c in calls if blocks and c.fwd and _is_reentrant(blocks, c.block)]:
        _match_reentrant(reentrant_calls)
    for call in calls:
        m = _first_mismatch(call, rtol)
        if m is not None:
            mismatches.append(m)
    if error is not None:
        rec = [c for c in calls if c.rec]
        where = rec[-1].stack[-1] if rec and rec[-1].stack else (blocks[0][0] if blocks else "")
        first_line = str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else ""
        if type(error).__name__ != "CheckpointError":
            first_line = f"the recompute raised {type(error).__name__}: {first_line}"
        mismatches.append(Mismatch(where, "checkpoint_error", first_line, CAUSES["checkpoint_error"]))
    return mismatches


def _is_reentrant(blocks: list[tuple[str, nn.Module]], name: str) -> bool:
    return any(n == name and m._distckpt_options.reentrant for n, m in blocks)


def _match_reentrant(calls: list[Call]) -> None:
    """Reentrant recomputes are recorded per block, in backward order: deal them back to the calls."""
    by_block: dict[str, list[Call]] = {}
    for c in calls:
        by_block.setdefault(c.block, []).append(c)
    for group in by_block.values():
        rec = [r for c in group for r in c.rec]
        for c in group:
            c.rec = []
        for c in reversed(group):  # backward recomputes the last call first
            n = len(c.fwd)
            c.rec, rec = rec[:n], rec[n:]
