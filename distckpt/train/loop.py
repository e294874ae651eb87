"""The training loop the launcher runs: micro-batches, guards, non-finite handling, SIGTERM, checkpoints.

Typed arguments in, no Hydra: ``launch/`` builds the pieces from the config and calls :func:`fit`.
One small all-reduce per step carries the losses and two flags (non-finite loss, stop requested),
so every rank takes the same decision at the same step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from distckpt._dist import local_tensor, rank_world
from distckpt._log import notify
from distckpt.errors import ConfigError
from distckpt.parallel.strategies import accumulate
from distckpt.train.callbacks import Callback
from distckpt.train.checkpoint import TrainState, resume_latest, save_checkpoint
from distckpt.train.data import ShardedLoader, TaskBatches, micro_batches
from distckpt.train.metrics import MetricSink, Stopwatch, peak_memory_mib

__all__ = ["Callback", "LoopOptions", "NonFiniteLossError", "fit"]

log = logging.getLogger("distckpt.train")


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm was NaN/inf and the run was configured to stop (or skipped too many)."""


@dataclass
class LoopOptions:
    """How :func:`fit` runs (mirrors the ``trainer`` config group)."""

    max_steps: int = 100
    grad_accum: int = 1
    clip_grad_norm: float = 0.0  # 0: no clipping (the norm is still computed, for the non-finite check)
    log_every: int = 10
    save_every: int = 0  # 0: save only at the end
    keep_last: int = 0
    eval_every: int = 0
    resume: bool = True
    on_nonfinite: str = "skip"  # "skip" the step, or "stop" the run
    max_consecutive_skips: int = 10  # "skip": stop after this many skipped steps in a row (0: no limit)
    task_weights: dict[str, float] = field(default_factory=dict)
    guard_every: int = 0
    progress: bool = True


@dataclass
class LoopResult:
    """What :func:`fit` reports; also printed as the end summary."""

    step: int = 0
    start_step: int = 0
    resumed_from: str | None = None
    losses: dict[str, float] = field(default_factory=dict)
    eval_loss: float | None = None
    skipped_steps: list[int] = field(default_factory=list)
    stopped_by_signal: bool = False
    seconds: float = 0.0
    samples_per_s: float = 0.0
    peak_memory_mib: float = 0.0
    guard: str = "off"
    guard_checks: int = 0  # steps whose gradients the GradSyncGuard compared across ranks (all agreed)
    checkpointed: list[str] = field(default_factory=list)  # FQNs of the activation-checkpointed blocks
    checkpoints: list[str] = field(default_factory=list)


def _all_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        # gloo has no AVG; a SUM also merges the flags (any rank > 0 means "some rank").
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


class _StopRequest:
    """Remembers a SIGTERM/SIGINT so that the loop stops at a step boundary (agreed across ranks)."""

    def __init__(self) -> None:
        self.requested = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _StopRequest:
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(ValueError):  # not the main thread: leave the signal alone
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def _params_finite(model: nn.Module) -> bool:
    bad = torch.zeros(1)
    for p in model.parameters():
        local = local_tensor(p)  # FSDP2 DTensor: check this rank's shard
        if not torch.isfinite(local.detach()).all():
            bad += 1
            break
    return _all_sum(bad).item() == 0


def fit(
    model: nn.Module,
    state: TrainState,
    data: ShardedLoader,
    *,
    opts: LoopOptions,
    run_dir: str | os.PathLike[str],
    sink: MetricSink,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    clip: Callable[[float], torch.Tensor] | None = None,
    guard: Any = None,
    callbacks: Sequence[Callback] = (),
) -> LoopResult:
    """Train ``model`` until ``opts.max_steps`` optimizer steps are done, resuming if a checkpoint exists.

    Args:
        model: the (wrapped, parallelized) model; ``model(batch)`` returns a dict of per-task losses.
        state: optimizer, scheduler, grad scaler and step, as saved in checkpoints.
        data: this rank's loader (its position is saved in ``state`` and restored on resume).
        opts: loop options.
        run_dir: the run folder; checkpoints go to ``run_dir/checkpoints``.
        sink: where metrics go (a no-op on ranks other than 0).
        device: where batches go.
        autocast: a context factory for the forward (mixed precision), or ``nullcontext``.
        clip: ``clip(max_norm) -> total_norm`` for this model's parallel layout (FSDP1 needs its own).
        guard: an object with ``.check()`` run after each backward (``distckpt.GradSyncGuard``), or ``None``.
        callbacks: hooks called on every rank (see :class:`distckpt.train.Callback`), in order.

    Returns:
        A :class:`LoopResult`.

    Raises:
        NonFiniteLossError: a non-finite loss with ``opts.on_nonfinite == "stop"``; more than
            ``opts.max_consecutive_skips`` skipped steps in a row; or every step of the run skipped.
        ResumeError: the run's checkpoints do not match the model/optimizer, or none is intact.
    """
    rank, world = rank_world()
    ckpt_dir = Path(run_dir) / "checkpoints"
    result = _begin(state, data, opts, ckpt_dir, rank, callbacks)
    bar = _progress_bar(opts, state.step) if rank == 0 and opts.progress and state.step < opts.max_steps else None
    clip = clip or (lambda max_norm: torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    run = _Run(
        model, state, data, opts, device, autocast, clip, guard, tuple(callbacks), sink, bar, result, rank, world
    )
    watch, t0 = Stopwatch(), time.perf_counter()
    samples_done = 0
    with _StopRequest() as stop:
        model.train()
        while state.step < opts.max_steps:
            step = state.step + 1  # the step being computed, 1-based
            bad, stop_now, norm = _train_step(run, step, stop.requested)
            samples_done += data.batch_size
            watch.add(data.batch_size)
            _after_step(run, step, norm, watch, bad, stop_now)
            if _save_or_stop(model, state, ckpt_dir, opts, result, step, stop_now):
                break
    if bar is not None:
        bar.close()
    result.step = state.step
    result.seconds = time.perf_counter() - t0
    result.samples_per_s = samples_done / max(result.seconds, 1e-9)
    result.peak_memory_mib = peak_memory_mib(device)
    return result


@dataclass
class _Run:
    """What every step of :func:`fit` works with: its arguments, the progress bar and the result so far."""

    model: nn.Module
    state: TrainState
    data: ShardedLoader
    opts: LoopOptions
    device: torch.device
    autocast: Callable[[], contextlib.AbstractContextManager[Any]]
    clip: Callable[[float], torch.Tensor]
    guard: Any
    callbacks: tuple[Callback, ...]
    sink: MetricSink
    bar: Any
    result: LoopResult
    rank: int
    world: int


def _begin(
    state: TrainState, data: ShardedLoader, opts: LoopOptions, ckpt_dir: Path, rank: int, callbacks: Sequence[Callback]
) -> LoopResult:
    """Before the first step: the loader joins the saved state, the newest intact checkpoint is resumed (if
    asked), and the callbacks hear where training starts."""
    result = LoopResult()
    if state.data is None:
        state.data = data  # the loader's position goes into every checkpoint
    if opts.resume:
        result.resumed_from = _resume(state, ckpt_dir, rank)
    result.start_step = state.step
    for cb in callbacks:
        cb.on_train_start(state.step)
    return result


def _train_step(run: _Run, step: int, stop_requested: bool) -> tuple[bool, bool, torch.Tensor]:
    """Optimizer step ``step`` on this rank: its micro-batches forward and backward, the guard and one all-reduce
    of the losses and flags (:func:`_check_and_reduce`), then the optimizer step (or a skip) and the scheduler.
    The global losses go into ``run.result.losses``. Returns ``(bad, stop_now, grad_norm)``, the same on every
    rank."""
    state, opts, result = run.state, run.opts, run.result
    micro = micro_batches(run.data.next_batch(), 0, 1, opts.grad_accum)  # this rank's part, already
    total, sums = _forward_backward(run.model, micro, step, opts, run.device, run.autocast, state.scaler)
    tasks = sorted(sums)
    for cb in run.callbacks:
        cb.on_after_backward(step, run.model)
    bad, stop_now, norm, packed = _check_and_reduce(
        total, sums, tasks, stop_requested, run.guard, state.scaler, state.optimizer, run.clip, opts, result
    )
    _optimizer_step(state, step, bad, opts, result, run.rank)
    if state.scheduler is not None:
        state.scheduler.step()
    state.step = step
    global_losses = {k: packed[3 + j].item() / run.world for j, k in enumerate(tasks)}
    result.losses = {"loss": packed[2].item() / run.world, **global_losses}
    return bad, stop_now, norm


def _after_step(run: _Run, step: int, norm: torch.Tensor, watch: Stopwatch, bad: bool, stop_now: bool) -> None:
    """After step ``step``: the callbacks, the evaluation and the log line when due, the progress bar."""
    opts, result = run.opts, run.result
    for cb in run.callbacks:
        cb.on_step_end(step, result)
    evaluated = bool(opts.eval_every and step % opts.eval_every == 0)
    if evaluated:
        result.eval_loss = _evaluate(run.model, run.data, run.device, run.autocast, opts.task_weights, run.world)
    if step % max(opts.log_every, 1) == 0 or step == opts.max_steps or stop_now:
        rate, mem = watch.lap(), peak_memory_mib(run.device)
        _log(run.sink, run.bar, step, result, run.state.optimizer, norm, rate, mem, bad, with_eval=evaluated)
    if run.bar is not None:
        run.bar.update(1)


def _save_or_stop(
    model: nn.Module,
    state: TrainState,
    ckpt_dir: Path,
    opts: LoopOptions,
    result: LoopResult,
    step: int,
    stop_now: bool,
) -> bool:
    """Checkpoint when due (and at the last step or on a stop request); True when the loop must stop."""
    last = step == opts.max_steps
    if last or stop_now:
        _refuse_all_skipped(result, step)
    if stop_now or last or (opts.save_every and step % opts.save_every == 0):
        _save(model, state, ckpt_dir, opts, result)
    if stop_now:
        result.stopped_by_signal = True
        log.warning("stop requested (SIGTERM/SIGINT): saved step %d on every rank", step)
    return stop_now


def _check_and_reduce(
    total: torch.Tensor,
    sums: dict[str, torch.Tensor],
    tasks: list[str],
    stop_requested: bool,
    guard: Any,
    scaler: Any,
    optimizer: torch.optim.Optimizer,
    clip: Callable[[float], torch.Tensor],
    opts: LoopOptions,
    result: LoopResult,
) -> tuple[bool, bool, torch.Tensor, torch.Tensor]:
    """Guard, unscale and clip, then one all-reduce of (non-finite, stop requested, losses), so every rank
    decides the same. Returns ``(bad, stop_now, grad_norm, summed values)``."""
    if guard is not None:  # a collective: every rank checks at every step (the guard skips by `every`)
        report = guard.check()
        result.guard_checks += bool(getattr(report, "grads_checked", True))
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = clip(opts.clip_grad_norm if opts.clip_grad_norm > 0 else math.inf)
    local_bad = not torch.isfinite(total) or (scaler is None and not torch.isfinite(norm))
    packed = _all_sum(
        torch.stack(
            [
                torch.tensor(float(local_bad)),
                torch.tensor(float(stop_requested)),
                total.cpu(),
                *(sums[k].cpu() for k in tasks),
            ]
        )
    )
    return packed[0].item() > 0, packed[1].item() > 0, norm, packed


def _resume(state: TrainState, ckpt_dir: Path, rank: int) -> str | None:
    """Load the newest intact checkpoint (the same on every rank); its path, or None."""
    path = resume_latest(state, ckpt_dir)
    if path is not None:
        log.info("resumed from %s (step %d)", path, state.step)
    return str(path) if path is not None else None


def _progress_bar(opts: LoopOptions, start: int) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is in the "launch" extra; without it there is no bar
        return None
    return tqdm(total=opts.max_steps, initial=start, desc="train", dynamic_ncols=True, leave=True)


def _forward_backward(
    model: nn.Module,
    micro: list[dict[str, torch.Tensor]],
    step: int,
    opts: LoopOptions,
    device: torch.device,
    autocast: Callable[[], Any],
    scaler: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward of one step's micro-batches, syncing gradients on the last only.

    Returns:
        the local loss (weighted sum of the task losses, averaged over micro-batches) and each task's
        local loss.
    """
    sums: dict[str, torch.Tensor] = {}
    total = torch.zeros((), device=device)
    for i, mb in enumerate(micro):
        sync = i == len(micro) - 1
        with contextlib.nullcontext() if sync else accumulate(model), autocast():
            losses = _step_losses(model, mb, device, opts.task_weights)
            loss = sum(opts.task_weights.get(k, 1.0) * v for k, v in losses.items()) / len(micro)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        total += loss.detach().float()
        for k, v in losses.items():
            sums[k] = sums.get(k, 0) + v.detach().float() / len(micro)
    return total, sums


def _to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _step_losses(
    model: nn.Module, batch: dict[str, Any], device: torch.device, weights: dict[str, float]
) -> dict[str, torch.Tensor]:
    """The task losses of one (micro-)batch; a :class:`TaskBatches` runs one forward per task batch.

    Of the forward on task ``t``'s batch, loss ``t`` counts; the other losses join with weight zero, so
    that every head takes part in every forward (DDP without unused-parameter search, FSDP2).

    Raises:
        ConfigError: as :func:`_task_losses`, or a task named after no loss the model returns.
    """
    if not isinstance(batch, TaskBatches):
        return _task_losses(model(_to(batch, device)), weights)
    losses = {}
    for task, part in batch.items():
        out = _task_losses(model(_to(part, device)), {})
        if task not in out:
            raise ConfigError(
                f"data.tasks.{task}: the model's forward on this task's batch returns {sorted(out)}; "
                "name each task after the loss it trains."
            )
        losses[task] = out[task] + sum(0.0 * v for k, v in out.items() if k != task)
    return _task_losses(losses, weights)


def _task_losses(out: Any, weights: dict[str, float]) -> dict[str, torch.Tensor]:
    """``out`` if it follows the model protocol: a dict of named scalar losses that has every weighted task.

    Raises:
        ConfigError: it is not such a dict, or ``weights`` names a task it lacks.
    """
    if not isinstance(out, dict) or not all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in out.values()):
        raise ConfigError(
            f"the model's forward(batch) returned {type(out).__name__}; it must return a dict of "
            "named scalar losses, one per task, e.g. {'lm': loss_lm, 'cls': loss_cls}."
        )
    if unknown := sorted(set(weights) - set(out)):
        raise ConfigError(
            f"trainer.task_weights names {unknown}, which the model does not return; its tasks are {sorted(out)}."
        )
    return out


def _optimizer_step(state: TrainState, step: int, bad: bool, opts: LoopOptions, result: LoopResult, rank: int) -> None:
    """Apply the step, or skip it (``bad``: a non-finite loss or norm on some rank) or stop."""
    optimizer, scaler = state.optimizer, state.scaler
    if not bad:
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return
    optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.update()
    if opts.on_nonfinite == "stop":
        raise NonFiniteLossError(
            f"non-finite loss or gradient norm at step {step} (on at least one rank); stopped without saving.\n"
            "Lower optim.lr, use precision=fp32, or set trainer.on_nonfinite=skip."
        )
    result.skipped_steps.append(step)
    run = _trailing_run(result.skipped_steps)
    if opts.max_consecutive_skips and run >= opts.max_consecutive_skips:
        raise NonFiniteLossError(
            f"{run} steps in a row ({step - run + 1}-{step}) had a non-finite loss or gradient norm and were "
            "skipped; stopped without saving.\nLower optim.lr, use precision=fp32, or raise "
            "trainer.max_consecutive_skips (0: no limit)."
        )
    if rank == 0:
        notify(f"step {step}: non-finite loss or gradient norm on some rank; step skipped", stacklevel=3)


def _refuse_all_skipped(result: LoopResult, step: int) -> None:
    """A run whose every step was skipped must not end like a success (nor save)."""
    if len(result.skipped_steps) == step - result.start_step:
        raise NonFiniteLossError(
            f"every step of this run ({result.start_step + 1}-{step}) was skipped for a non-finite loss or "
            "gradient norm; stopped without saving.\nLower optim.lr, check the data and the model "
            "(trainer.on_nonfinite=stop names the first bad step)."
        )


def _trailing_run(steps: list[int]) -> int:
    """How many of ``steps`` (ascending) end in a run of consecutive numbers."""
    n = 1 if steps else 0
    while n < len(steps) and steps[-n - 1] == steps[-n] - 1:
        n += 1
    return n


def _log(
    sink: MetricSink,
    bar: Any,
    step: int,
    result: LoopResult,
    optimizer: torch.optim.Optimizer,
    norm: torch.Tensor,
    rate: float,
    mem: float,
    bad: bool,
    with_eval: bool,
) -> None:
    record = {
        "step": step,
        **result.losses,
        "lr": optimizer.param_groups[0]["lr"],
        "grad_norm": float(norm),
        "samples_per_s": rate,
        "peak_mem_mib": mem,
        "skipped": bad,
    }
    if with_eval:
        record["eval_loss"] = result.eval_loss
    sink.log(record)
    if bar is not None:
        bar.set_postfix(loss=f"{result.losses['loss']:.4f}", sps=f"{rate:.0f}", mem=f"{mem:.0f}MiB")


def _save(model: nn.Module, state: TrainState, ckpt_dir: Path, opts: LoopOptions, result: LoopResult) -> None:
    if not _params_finite(model):
        raise NonFiniteLossError(
            f"parameters are non-finite at step {state.step}; refusing to write a checkpoint. "
            "Lower optim.lr or use trainer.on_nonfinite=stop to find the first bad step."
        )
    result.checkpoints.append(str(save_checkpoint(state, ckpt_dir, keep_last=opts.keep_last)))


def _evaluate(
    model: nn.Module,
    data: ShardedLoader,
    device: torch.device,
    autocast: Callable[[], Any],
    weights: dict[str, float],
    world: int,
) -> float | None:
    """The weighted loss over the eval split, averaged over its global batches (every rank has as many)."""
    model.eval()
    total, n = torch.zeros(()), 0
    try:
        with torch.no_grad(), autocast():
            for batch in data.eval_batches():
                losses = _step_losses(model, batch, device, {})
                total += sum(weights.get(k, 1.0) * v.float() for k, v in losses.items()).cpu()
                n += 1
    finally:
        model.train()
    if n == 0:
        return None
    return _all_sum(total).item() / (n * world)
