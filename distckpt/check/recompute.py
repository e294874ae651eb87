"""Run-time check: the checkpointed recompute reproduces the forward (:func:`verify_recompute`).

One step runs with checkpointing as configured and once without; a dispatch-mode recorder compares
every op of each block's recompute with the same op of its forward, which names the first module that
differs and the likely cause.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.utils.checkpoint as tuc

from distckpt import _torch_compat as compat
from distckpt._dist import local_shard as _local
from distckpt._dist import unwrap_ddp as _inner
from distckpt.apply.compile import uncompiled
from distckpt.check.op_record import CAUSES, Call, Mismatch, op_mismatches, recording, storage_of
from distckpt.errors import ConfigError, RecomputeMismatchError
from distckpt.runtime.swap import _clean_fqn, checkpoint_mode, checkpointing_disabled, is_checkpointed

__all__ = ["Mismatch", "RecomputeReport", "verify_recompute"]


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
    op of the recompute against the same op of the forward (sums of its outputs, integer outputs
    element by element), which names the first module whose recompute differs; a routing op (top-k,
    sort, argmax) that decided otherwise comes first, as ``[routing]`` at its router (checkpointed
    mixture-of-experts layers replay their forward's routing unless inside
    :func:`distckpt.routing_replay_disabled`). Blocks checkpointed with ``reentrant=True`` are compared
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
    calls: list[Call] = []
    with uncompiled(inner):  # blocks compiled per block: the recording below checks the checkpointing, eagerly
        with_ckpt, without, error = _run_both(model, loss_fn, blocks, params, buffers, calls)

    mismatches = op_mismatches(calls, blocks, error, rtol)
    if not _close(with_ckpt.loss, without.loss, rtol, atol):
        mismatches.append(
            Mismatch(
                "",
                "loss",
                f"loss {float(with_ckpt.loss):.8g} with checkpointing, {float(without.loss):.8g} without",
                CAUSES["loss"],
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
    calls: list[Call],
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
        with recording(blocks, calls, phase, frozenset(storage_of(b) for _, b in buffers)):
            loss = _scalar(loss_fn(model))
            phase[0] = "rec"
            try:
                loss.backward()
            except tuc.CheckpointError as e:  # torch's own check of the recomputed saved tensors
                error = e
            except RuntimeError as e:
                # A recompute that ran other ops than its forward can fail inside itself (a selective block's saved
                # matmul output beside tensors of other shapes): reported as the recompute's error.
                if not any(c.rec for c in calls):
                    raise
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
                        CAUSES["gradient"],
                    )
                )
            continue
        diff = float((a.double() - b.double()).abs().max()) if a.shape == b.shape and a.numel() else 0.0
        max_diff = diff if math.isnan(diff) else max(max_diff, diff)  # max(0.0, nan) is 0.0: keep the nan
        if not _close(a, b, rtol, atol):
            what = f"max abs diff {diff:.3g}" if a.shape == b.shape else f"shape {list(a.shape)} vs {list(b.shape)}"
            mismatches.append(
                Mismatch(
                    name.rpartition(".")[0], "gradient", f"gradient of {name} differs ({what})", CAUSES["gradient"]
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
                    CAUSES["nonfinite"],
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
                    CAUSES[kind],
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


def _dedupe(mismatches: list[Mismatch]) -> list[Mismatch]:
    seen: set[tuple[str, str]] = set()
    out = []
    for m in mismatches:
        if (m.module, m.kind) not in seen:
            seen.add((m.module, m.kind))
            out.append(m)
    return out
