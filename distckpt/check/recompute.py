"""Run-time check: the checkpointed recompute reproduces the forward (:func:`verify_recompute`).

One step runs with checkpointing as configured and once without; a dispatch-mode recorder compares
every op of each block's recompute with the same op of its forward, which names the first module that
differs and the likely cause.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.utils.checkpoint as tuc

from distckpt import _torch_compat as compat
from distckpt._dist import local_shard as _local
from distckpt._dist import unwrap_ddp as _inner
from distckpt.apply.compile import uncompiled
from distckpt.errors import ConfigError, RecomputeMismatchError
from distckpt.runtime.swap import _clean_fqn, checkpoint_mode, checkpointing_disabled, is_checkpointed

__all__ = ["Mismatch", "RecomputeReport", "verify_recompute"]

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
        kind: ``"rng"``, ``"control_flow"``, ``"shape"``, ``"state"``, ``"batchnorm"``, ``"buffer"``,
            ``"gradient"``, ``"loss"`` or ``"checkpoint_error"``.
        detail: what differs.
        cause: the likely cause and the fix, in words.
    """

    module: str
    kind: str
    detail: str
    cause: str


@dataclass
class RecomputeReport:
    """The result of :func:`verify_recompute`.

    Attributes:
        ok: whether loss, every gradient and every buffer matched.
        blocks: FQNs of the checkpointed blocks that ran.
        loss: (with checkpointing, without).
        max_grad_diff: largest absolute gradient difference over all parameters.
        mismatches: what differs, the first one (in forward order) first.
    """

    ok: bool
    blocks: list[str]
    loss: tuple[float, float]
    max_grad_diff: float
    mismatches: list[Mismatch]

    def __str__(self) -> str:
        if self.ok:
            return (
                f"recompute exact: {len(self.blocks)} checkpointed block(s), loss {self.loss[0]:.6g}, "
                f"max gradient difference {self.max_grad_diff:.3g}"
            )
        return "recompute differs:\n" + "\n".join(
            f"  {m.module} [{m.kind}]: {m.detail}. {m.cause}" for m in self.mismatches
        )


_CAUSES = {
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


def _storage(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (subclasses)
        return -1


def _op_record(
    name: str, module: str, out: Any, state: frozenset[int] = frozenset()
) -> tuple[str, str, list[tuple[Any, ...]]]:
    tensors = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
    values = []
    for t in tensors:
        t = t.detach()
        # Buffers updated in place (BatchNorm statistics) legitimately differ in the recompute;
        # whether their final value is right is checked on the buffers themselves.
        if t.is_complex() or t.is_sparse or t.device.type == "meta" or _storage(t) in state:
            values.append((tuple(t.shape), t.dtype, None, None))
            continue
        t64 = t.double()
        values.append((tuple(t.shape), t.dtype, float(t64.sum()), float((t64 * t64).sum())))
    return name, module, values


@dataclass
class _Call:
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
    from distckpt._torch_compat import torch_dispatch_mode

    class _Recorder(torch_dispatch_mode()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            if func.name() in _IGNORED_OPS:
                return out
            log.append(_op_record(str(func.name()), stack[-1], out, state))
            return out

    return _Recorder()


@contextlib.contextmanager
def _recording(
    blocks: list[tuple[str, nn.Module]], calls: list[_Call], phase: list[str], state: frozenset[int]
) -> Iterator[None]:
    """Record per checkpointed call the ops of its forward and of its recompute.

    Non-reentrant blocks: through their ``context_fn`` (checkpoint enters one context around the
    forward and another around the recompute). Reentrant blocks accept no ``context_fn``: their
    submodules' outputs are recorded with forward hooks, which fire in both passes.
    """
    handles = []
    saved: list[tuple[nn.Module, Any]] = []
    current: dict[int, _Call] = {}
    try:
        for bname, block in blocks:
            opts = block._distckpt_options
            saved.append((block, opts))

            def pre(mod: nn.Module, _args: Any, bname: str = bname, opts: Any = opts) -> None:
                if phase[0] == "fwd":
                    call = _Call(len(calls), bname, opts.preserve_rng_state, stack=[bname])
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
                        log.append(_op_record(f"{type(_m).__name__} output", full, out, state))

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
    (_, _, s1, q1), (_, _, s2, q2) = a, b
    if s1 is None or s2 is None:
        return False
    if not all(math.isfinite(x) for x in (s1, q1, s2, q2)):  # the bounds below are inf > inf: never true
        return not all((math.isnan(x) and math.isnan(y)) or x == y for x, y in ((s1, s2), (q1, q2)))
    # Outputs differing by d (L2) change the sum of squares by at most 2|x||d| and the sum by at
    # most sqrt(n)|d|: both bounds at |d| = rtol * |x|.
    norm = math.sqrt(max(q1, q2, 0.0))
    n = max(1, math.prod(a[0]))
    return abs(q1 - q2) > 2 * rtol * norm * norm + 1e-30 or abs(s1 - s2) > rtol * norm * math.sqrt(n) + 1e-30


def _first_mismatch(call: _Call, rtol: float) -> Mismatch | None:
    """The first op (or submodule output) whose recompute differs from its forward."""
    fwd, rec = call.fwd, call.rec
    if not rec:
        return None
    # Non-reentrant checkpoint stops the recompute once it has what backward needs: compare the prefix.
    for k, ((fname, fmod, fvals), (rname, _rmod, rvals)) in enumerate(zip(fwd, rec)):
        if fname != rname or len(fvals) != len(rvals):
            return Mismatch(
                fmod,
                "control_flow",
                f"op #{k} of the recompute is {rname}, the forward ran {fname}",
                _CAUSES["control_flow"],
            )
        if any(_UNINITIALIZED in fname for _UNINITIALIZED in _UNINITIALIZED_OPS):
            continue
        for fv, rv in zip(fvals, rvals):
            if fv[0] != rv[0] or fv[1] != rv[1]:
                return Mismatch(
                    fmod,
                    "shape",
                    f"{fname} (op #{k}) gave shape {list(rv[0])} {rv[1]} in the "
                    f"recompute, {list(fv[0])} {fv[1]} in the forward",
                    _CAUSES["shape"],
                )
            if _values_differ(fv, rv, rtol):
                random = any(r in fname.lower() for r in _RANDOM_OPS)
                kind = "rng" if random else "state"
                cause = _CAUSES[("rng_preserved" if call.preserve_rng else "rng") if random else "state"]
                return Mismatch(
                    fmod,
                    kind,
                    f"{fname} (op #{k}) gave other values in the recompute "
                    f"(sum {rv[2]:.6g} vs {fv[2]:.6g} in the forward)",
                    cause,
                )
    return None


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _grads(params: list[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else _local(p.grad)[0].detach().clone() for n, p in params}


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> bool:
    if a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    a64, b64 = a.double(), b.double()
    scale = float(b64.abs().max()) if b64.isfinite().all() else 0.0
    return torch.allclose(a64, b64, rtol=rtol, atol=atol + rtol * scale, equal_nan=True)


def _owner_kind(model: nn.Module, buffer_fqn: str) -> str:
    owner = buffer_fqn.rpartition(".")[0]
    try:
        mod = model.get_submodule(owner) if owner else model
    except AttributeError:
        return "buffer"
    return "batchnorm" if isinstance(mod, compat.norm_base_class()) else "buffer"


def _scalar(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise ConfigError(
            f"verify_recompute: loss_fn(model) must return a scalar tensor, got {type(loss).__name__}"
            f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}. Return loss.mean() or sum."
        )
    return loss


def _step(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor]) -> torch.Tensor:
    loss = _scalar(loss_fn(model))
    loss.backward()
    return loss.detach().clone()


def verify_recompute(
    model: nn.Module,
    loss_fn: Callable[[nn.Module], torch.Tensor],
    *,
    rtol: float = 1e-5,
    atol: float = 1e-8,
    raise_on_mismatch: bool = True,
) -> RecomputeReport:
    """Run one step with checkpointing as configured and once without; check they agree.

    Both runs start from the same CPU and CUDA RNG state and the same buffers. Compared: the loss,
    every gradient, every buffer (BatchNorm statistics), and, inside each checkpointed block, every
    op of the recompute against the same op of the forward (sums of its outputs), which names the
    first module whose recompute differs. Blocks checkpointed with ``reentrant=True`` are compared
    at the outputs of their submodules instead of op by op. When the model is wrapped in DDP or
    FSDP, each run synchronizes gradients: call it on all ranks (or pass the unwrapped model).

    Afterwards the model is as before: RNG states, buffers and each parameter's ``.grad`` (the
    same tensor object, or None) are restored; no optimizer state is touched.

    Args:
        model: a model with blocks checkpointed by :func:`distckpt.apply.wrap`.
        loss_fn: ``loss_fn(model) -> scalar tensor``: one forward on a fixed batch. It may change
            state (e.g. a task flag) to reproduce what training does.
        rtol: relative tolerance of every comparison.
        atol: absolute tolerance added for gradients and buffers.
        raise_on_mismatch: raise instead of returning a report with ``ok=False``.

    Returns:
        A :class:`RecomputeReport`.

    Raises:
        RecomputeMismatchError: something differs (with ``raise_on_mismatch``); the message names
            the first module whose recompute differs and the likely cause; ``.report`` holds the report.
        ConfigError: ``loss_fn`` does not return a scalar tensor.
    """
    inner = _inner(model)
    # Offloaded blocks recompute nothing: no recompute to compare op by op (their saved tensors' round trip
    # to the host is still checked, by the gradients below).
    blocks = [
        (_clean_fqn(n), m) for n, m in inner.named_modules() if is_checkpointed(m) and checkpoint_mode(m) != "offload"
    ]
    params = [(_clean_fqn(n), p) for n, p in inner.named_parameters()]
    buffers = [(_clean_fqn(n), b) for n, b in inner.named_buffers()]
    calls: list[_Call] = []
    with uncompiled(inner):  # blocks compiled per block: the recording below checks the checkpointing, eagerly
        with_ckpt, without, error = _run_both(model, loss_fn, blocks, params, buffers, calls)

    mismatches = _op_mismatches(calls, blocks, error, rtol)
    if not _close(with_ckpt.loss, without.loss, rtol, atol):
        mismatches.append(
            Mismatch(
                "",
                "loss",
                f"loss {float(with_ckpt.loss):.8g} with checkpointing, {float(without.loss):.8g} without",
                _CAUSES["loss"],
            )
        )
    grad_mismatches, max_diff = _grad_mismatches(params, with_ckpt.grads, without.grads, rtol, atol)
    mismatches += grad_mismatches
    mismatches += _nonfinite(with_ckpt, without)
    mismatches += _buffer_mismatches(inner, buffers, with_ckpt.buffers, without.buffers, rtol, atol)
    report = RecomputeReport(
        ok=not mismatches,
        blocks=[b for b, _ in blocks],
        loss=(float(with_ckpt.loss), float(without.loss)),
        max_grad_diff=max_diff,
        mismatches=_dedupe(mismatches),
    )
    if mismatches and raise_on_mismatch:
        raise _mismatch_error(report)
    return report


@dataclass
class _Run:
    """What one step left behind: its loss, every gradient (by FQN) and every buffer (in order)."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    buffers: list[torch.Tensor]


def _run_both(
    model: nn.Module,
    loss_fn: Callable[[nn.Module], torch.Tensor],
    blocks: list[tuple[str, nn.Module]],
    params: list[tuple[str, nn.Parameter]],
    buffers: list[tuple[str, torch.Tensor]],
    calls: list[_Call],
) -> tuple[_Run, _Run, Exception | None]:
    """One step with checkpointing (recording each block's forward and recompute into ``calls``), then
    one without, from the same RNG state and buffers; afterwards RNG, buffers and ``.grad`` are restored.

    Returns:
        The run with checkpointing, the run without, and torch's ``CheckpointError`` if it raised one.
    """
    inner = _inner(model)
    before_grads = [p.grad for _, p in params]
    before_bufs = [b.detach().clone() for _, b in buffers]
    rng = _rng_state()
    phase = ["fwd"]
    error: Exception | None = None

    def restore_buffers() -> None:
        with torch.no_grad():
            for (_, b), v in zip(buffers, before_bufs):
                b.copy_(v)

    try:
        for _, p in params:
            p.grad = None
        with _recording(blocks, calls, phase, frozenset(_storage(b) for _, b in buffers)):
            loss = _scalar(loss_fn(model))
            phase[0] = "rec"
            try:
                loss.backward()
            except tuc.CheckpointError as e:  # torch's own check of the recomputed saved tensors
                error = e
            loss_a = loss.detach().clone()
        with_ckpt = _Run(loss_a, _grads(params), [b.detach().clone() for _, b in buffers])
        restore_buffers()
        _set_rng_state(rng)
        for _, p in params:
            p.grad = None
        with checkpointing_disabled(inner):
            loss_b = _step(model, loss_fn)
        without = _Run(loss_b, _grads(params), [b.detach().clone() for _, b in buffers])
    finally:
        restore_buffers()
        _set_rng_state(rng)
        for (_, p), g in zip(params, before_grads):
            p.grad = g
    return with_ckpt, without, error


def _op_mismatches(
    calls: list[_Call], blocks: list[tuple[str, nn.Module]], error: Exception | None, rtol: float
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
        mismatches.append(
            Mismatch(
                where, "checkpoint_error", str(error).strip().splitlines()[0].rstrip("."), _CAUSES["checkpoint_error"]
            )
        )
    return mismatches


def _grad_mismatches(
    params: list[tuple[str, nn.Parameter]],
    grads_a: dict[str, torch.Tensor | None],
    grads_b: dict[str, torch.Tensor | None],
    rtol: float,
    atol: float,
) -> tuple[list[Mismatch], float]:
    """Gradients that differ with and without checkpointing, and the largest absolute difference."""
    mismatches: list[Mismatch] = []
    max_diff = 0.0
    for name, _ in params:
        a, b = grads_a[name], grads_b[name]
        if a is None or b is None:
            if (a is None) != (b is None):
                mismatches.append(
                    Mismatch(
                        name.rpartition(".")[0],
                        "gradient",
                        f"{name} has a gradient only {'without' if a is None else 'with'} checkpointing",
                        _CAUSES["gradient"],
                    )
                )
            continue
        diff = float((a.double() - b.double()).abs().max()) if a.shape == b.shape and a.numel() else 0.0
        max_diff = diff if math.isnan(diff) else max(max_diff, diff)  # max(0.0, nan) is 0.0: keep the nan
        if not _close(a, b, rtol, atol):
            what = f"max abs diff {diff:.3g}" if a.shape == b.shape else f"shape {list(a.shape)} vs {list(b.shape)}"
            mismatches.append(
                Mismatch(
                    name.rpartition(".")[0], "gradient", f"gradient of {name} differs ({what})", _CAUSES["gradient"]
                )
            )
    return mismatches, max_diff


def _nonfinite(with_ckpt: _Run, without: _Run) -> list[Mismatch]:
    """A loss or gradient that is not finite in either run (equal nans would otherwise pass as exact):
    the loss if it is the one, else the first such gradient."""
    candidates = [("", "loss", with_ckpt.loss, without.loss)]
    candidates += [(n.rpartition(".")[0], f"gradient of {n}", g, without.grads[n]) for n, g in with_ckpt.grads.items()]
    for module, what, a, b in candidates:
        bad = [run for run, t in (("with", a), ("without", b)) if t is not None and not bool(t.isfinite().all())]
        if bad:
            return [
                Mismatch(
                    module,
                    "nonfinite",
                    f"the {what} is not finite {' and '.join(bad)} checkpointing",
                    _CAUSES["nonfinite"],
                )
            ]
    return []


def _buffer_mismatches(
    inner: nn.Module,
    buffers: list[tuple[str, torch.Tensor]],
    bufs_a: list[torch.Tensor],
    bufs_b: list[torch.Tensor],
    rtol: float,
    atol: float,
) -> list[Mismatch]:
    """Buffers (BatchNorm statistics, ...) that end the step differently with checkpointing."""
    mismatches = []
    for (name, _), a, b in zip(buffers, bufs_a, bufs_b):
        if not _close(a, b, rtol, atol):
            kind = _owner_kind(inner, name)
            mismatches.append(
                Mismatch(
                    name.rpartition(".")[0],
                    kind,
                    f"buffer {name} differs after the step with checkpointing",
                    _CAUSES[kind],
                )
            )
    return mismatches


def _mismatch_error(report: RecomputeReport) -> RecomputeMismatchError:
    first = report.mismatches[0]
    where = f"the recompute of {first.module}" if first.module else "the checkpointed step"
    err = RecomputeMismatchError(
        f"{where} differs from its forward: {first.detail}. {first.cause}"
        + (f" ({len(report.mismatches) - 1} more difference(s) in .report)" if len(report.mismatches) > 1 else "")
    )
    err.report = report  # type: ignore[attr-defined]
    return err


def _is_reentrant(blocks: list[tuple[str, nn.Module]], name: str) -> bool:
    return any(n == name and m._distckpt_options.reentrant for n, m in blocks)


def _match_reentrant(calls: list[_Call]) -> None:
    """Reentrant recomputes are recorded per block, in backward order: deal them back to the calls."""
    by_block: dict[str, list[_Call]] = {}
    for c in calls:
        by_block.setdefault(c.block, []).append(c)
    for group in by_block.values():
        rec = [r for c in group for r in c.rec]
        for c in group:
            c.rec = []
        for c in reversed(group):  # backward recomputes the last call first
            n = len(c.fwd)
            c.rec, rec = rec[:n], rec[n:]


def _dedupe(mismatches: list[Mismatch]) -> list[Mismatch]:
    seen: set[tuple[str, str]] = set()
    out = []
    for m in mismatches:
        if (m.module, m.kind) not in seen:
            seen.add((m.module, m.kind))
            out.append(m)
    return out
