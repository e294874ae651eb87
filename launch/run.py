"""``train(cfg)``: set up the process group, build everything from the config, run the loop, print a summary.

``launch/train.py`` calls it under ``@hydra.main``; tests call it directly on a composed config.
"""

from __future__ import annotations

import logging
import os
import random
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

import distckpt
from distckpt._dist import broadcast_object, rank_world
from distckpt._log import Notice
from distckpt._spawn import free_port
from distckpt.errors import ConfigError, first_lines
from distckpt.select import CHECKPOINT_MODES
from distckpt.train import Callback, LoopOptions, LoopResult, MetricSink, TrainState, fit, format_summary
from distckpt.train.data import TaskBatches
from launch.ac import wrap_args
from launch.build import (
    apply_tensor_parallel,
    autocast_factory,
    build_data,
    build_model,
    build_optimizer,
    build_scaler,
    clip_fn,
    layout_of,
    parallel_kwargs,
    tensor_parallel_mesh,
)
from launch.config import validate
from launch.hf import hf_inner, save_hf
from launch.loggers import build_writers

log = logging.getLogger("distckpt.launch")


def _init_distributed(strategy: str, device: torch.device) -> bool:
    """Join the job's process group (torchrun's env) or make a 1-process one; True if this call made it."""
    if dist.is_initialized() or (strategy == "none" and int(os.environ.get("WORLD_SIZE", "1")) == 1):
        return False
    if "RANK" not in os.environ:  # `python launch/train.py strategy=ddp`: a job of one process
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(minutes=10)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if restart == 0:
        dist.init_process_group(backend, timeout=timeout)
        return True
    # After a torchrun restart the agent's store may still hold the dead attempt's keys (gloo's peer
    # addresses): measured here, the new workers then connect to dead ports and hang in
    # init_process_group. A key prefix per attempt keeps every attempt's rendezvous apart.
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not agent_store and rank == 0,
        timeout=timeout,
    )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"distckpt/attempt_{restart}", store),
        rank=rank,
        world_size=world,
        timeout=timeout,
    )
    return True


def _device(name: str) -> torch.device:
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is visible; use trainer.device=auto or cpu.")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def _run_dir(run_dir: str | os.PathLike[str] | None) -> str:
    if run_dir is None:
        from hydra.core.hydra_config import HydraConfig

        if not HydraConfig.initialized():
            raise ConfigError("train(cfg) outside @hydra.main needs run_dir=...; pass the folder for this run.")
        run_dir = HydraConfig.get().runtime.output_dir
    return broadcast_object(str(Path(run_dir).resolve()))  # every rank uses rank 0's folder, whatever its own is


def _wrap(model: torch.nn.Module, cfg: DictConfig, example: dict[str, torch.Tensor]) -> None:
    """The ``ac`` group applied (nothing for ``ac=none``), a budget planned on this rank's micro-batch."""
    wrap_args(cfg, rank_world()[1]).wrap(model, example_inputs=(example,))


def _optional_guard(model: torch.nn.Module, every: int) -> Any:
    return distckpt.GradSyncGuard(model, every=every) if every > 0 else None


def _optional_verify(model: torch.nn.Module, example: dict[str, torch.Tensor], enabled: bool) -> str:
    if not enabled:
        return "off"
    report = distckpt.verify_recompute(model, lambda m: sum(m(example).values()))
    # RecomputeMismatchError propagates: training on a recompute that differs would be silently wrong.
    return "ok (recompute equals forward)" if getattr(report, "ok", True) else str(report)


def _quiet_torch_warnings() -> None:
    # FSDP1's state_dict path warns on every save about its own deprecated internals (ShardedTensor, a
    # default-device helper); the user can do nothing about them, and they bury the progress bar.
    warnings.filterwarnings("ignore", message="Please use DTensor instead", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*_get_pg_default_device.*")
    warnings.filterwarnings("ignore", message="Multiple backends are registered with this ProcessGroup")


def train(cfg: DictConfig, run_dir: str | os.PathLike[str] | None = None, *, validated: bool = False) -> LoopResult:
    """Train as ``cfg`` says, in this process (one rank of a torchrun job, or alone).

    Args:
        cfg: a config composed from ``conf/`` (``@hydra.main`` or ``hydra.compose``).
        run_dir: the run folder; by default Hydra's ``hydra.run.dir``.
        validated: ``validate(cfg, WORLD_SIZE)`` ran on this config already (launch/train.py checks it before
            the run starts); else it runs here.

    Returns:
        The loop's result (final step, losses, checkpoints, throughput).

    Raises:
        ConfigError: a bad value or combination, before anything is written.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not validated:
        validate(cfg, world)
    _quiet_torch_warnings()
    # What a run's safety depends on (a checkpoint skipped, a logger's fallback, ...) distckpt logs on the
    # `distckpt` logger, which Hydra's job logging shows, and also warns (distckpt._log.notify): said once here.
    warnings.filterwarnings("ignore", category=Notice)
    t = cfg.trainer
    user_callbacks = _callbacks(t.callbacks)  # a bad entry is a ConfigError before anything is written
    device = _device(t.device)
    # The process group stays up when train() returns: tearing a gloo group down from Python can
    # deadlock (measured here: the DDP reducer's destructor joins gloo's worker thread while holding
    # the GIL, and that thread waits for the GIL to free a tensor). launch/train.py exits with os._exit.
    _init_distributed(cfg.strategy.name, device)
    rank = rank_world()[0]
    if rank != 0:
        logging.getLogger("distckpt").setLevel(logging.WARNING)
    path = _run_dir(run_dir)
    if rank == 0:
        Path(path).mkdir(parents=True, exist_ok=True)

    torch.manual_seed(t.seed)  # the same initial parameters on every rank
    # The layout says the strategy, hsdp's mesh (world // shard_size, shard_size), strategy.tp's ("dp", "tp") mesh and
    # strategy.compile (each block compiled, before sharding).
    layout = layout_of(cfg.strategy, world)
    tp_mesh = tensor_parallel_mesh(layout, device)  # the tp ranks of one replica read the same data
    ranks = None if tp_mesh is None else (tp_mesh["dp"].get_local_rank(), layout.world_size)
    data = build_data(cfg.data, cfg.model, device, allow_reshuffle=t.allow_reshuffle, ranks=ranks)
    model = build_model(cfg.model, cfg.data)
    example = data.example(t.grad_accum)
    if isinstance(example, TaskBatches):  # data=multitask: the model sees one task's batch per forward
        example = next(iter(example.values()))
    # On the device before wrap: a budget measures its sample step where training runs (budget:auto
    # reads the CUDA device's memory), and the example batch goes with it.
    model.to(device)
    example = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in example.items()}
    apply_tensor_parallel(model, tp_mesh)  # the order: tensor parallel, checkpointing, compile, sharding
    _wrap(model, cfg, example)
    blocks = distckpt.checkpointed(model)  # before parallelize: the user's names, no wrapper prefixes
    verified = _optional_verify(model, example, t.verify_recompute)
    inner = hf_inner(model)  # the HF model before parallelize, for RUN_DIR/hf/ at the end
    model = distckpt.parallelize(
        model, layout, graph=cfg.strategy.graph, device_mesh=tp_mesh, **parallel_kwargs(cfg.precision, layout)
    )
    optimizer, scheduler = build_optimizer(cfg.optim, model, t.max_steps)
    state = TrainState(model, optimizer, scheduler, build_scaler(cfg.precision, layout, device), data=data)
    guard = _optional_guard(model, t.guard_every)
    torch.manual_seed(t.seed + 1 + rank)  # dropout: one stream per rank, restored on resume
    # Python's own RNG too (user code may draw from it; it is saved in checkpoints): unseeded, every launch
    # would start from fresh OS entropy and no two runs, resumed or not, would hold the same RNG state.
    random.seed(t.seed + 1 + rank)

    writers = build_writers(cfg.logger, path, OmegaConf.to_container(cfg, resolve=True), enabled=rank == 0)
    sink = MetricSink(path, writers=writers, enabled=rank == 0)
    opts = LoopOptions(
        max_steps=t.max_steps,
        grad_accum=t.grad_accum,
        clip_grad_norm=t.clip_grad_norm,
        log_every=t.log_every,
        save_every=t.save_every,
        keep_last=t.keep_last,
        eval_every=t.eval_every,
        resume=t.resume,
        on_nonfinite=t.on_nonfinite,
        max_consecutive_skips=t.max_consecutive_skips,
        guard_every=t.guard_every,
        progress=t.progress,
        task_weights=dict(t.task_weights),
    )
    callbacks = [_WriteConfig(cfg, path, rank), *user_callbacks]
    try:
        result = fit(
            model,
            state,
            data,
            opts=opts,
            run_dir=path,
            sink=sink,
            device=device,
            autocast=autocast_factory(cfg.precision, device),
            clip=clip_fn(model, layout),
            guard=guard,
            callbacks=callbacks,
        )
    finally:
        sink.close()
    if inner is not None and not result.stopped_by_signal and result.step == t.max_steps:
        save_hf(model, inner, path)  # every rank: gathers the full state dict; rank 0 writes
    result.guard = _guard_report(guard, result.guard_checks, verified)
    result.checkpointed = blocks
    if rank == 0:
        print(_summary(cfg, result, path, model), flush=True)
    return result


class _WriteConfig(Callback):
    """Writes the resolved ``config.yaml`` once the resume succeeded: a run refused on resume keeps the
    config its checkpoints were written with."""

    def __init__(self, cfg: DictConfig, path: str, rank: int) -> None:
        self.cfg, self.path, self.rank = cfg, path, rank

    def on_train_start(self, step: int) -> None:
        if self.rank == 0:
            (Path(self.path) / "config.yaml").write_text(OmegaConf.to_yaml(self.cfg, resolve=True))


def _callbacks(entries: Any) -> list[Callback]:
    """``trainer.callbacks``: each entry a ``{_target_: pkg.Class, ...}`` node, instantiated by Hydra."""
    from hydra.utils import instantiate

    made = []
    for e in entries:
        target = e.get("_target_") if hasattr(e, "get") else e
        try:
            cb = instantiate(e)
        except Exception as err:  # hydra's InstantiationException wraps the import or constructor error
            raise ConfigError(f"trainer.callbacks: cannot make {target}: {first_lines(err)}") from None
        if not isinstance(cb, Callback):
            raise ConfigError(
                f"trainer.callbacks: {target} made a {type(cb).__name__}, not a distckpt.train.Callback; subclass it."
            )
        made.append(cb)
    return made


def _mesh(cfg: DictConfig, world: int) -> str:
    layout = layout_of(cfg.strategy, world)
    shards = layout.shard_size
    if layout.tp > 1:
        return f" (mesh {layout.world_size} dp x {layout.tp} tp)"
    return f" (mesh {world // shards} replicate x {shards} shard)" if shards else ""


def _guard_report(guard: Any, checks: int, verified: str) -> str:
    world = rank_world()[1]
    if guard is None:
        sync = "off"
    elif world > 1:
        sync = f"{checks} steps compared across {world} ranks, all in sync"
    else:  # one process: nothing to compare, only parameters that get no gradient are watched
        sync = f"{checks} steps checked (one process: no-gradient check only)"
    return f"grad sync: {sync}; recompute check: {verified}"


def _checkpointed_by_mode(modes: dict[str, str]) -> str:
    """``full: h.0, h.1; selective: h.2, ... (9 blocks)``: what each checkpointed block got (a budget mixes)."""
    parts = []
    for mode in reversed(CHECKPOINT_MODES[1:]):  # offload, full, selective, pointwise
        blocks = [b for b, m in modes.items() if m == mode]
        if blocks:
            more = f", ... ({len(blocks)} blocks)" if len(blocks) > 4 else ""
            parts.append(f"{mode}: " + ", ".join(blocks[:4]) + more)
    return "; ".join(parts)


def _summary(cfg: DictConfig, r: LoopResult, path: str, model: torch.nn.Module) -> str:
    shown = _checkpointed_by_mode(distckpt.checkpointed(model, modes=True) or dict.fromkeys(r.checkpointed, "full"))
    world = rank_world()[1]
    losses = ", ".join(f"{k} {v:.4f}" for k, v in r.losses.items())
    mem_kind = "CUDA allocated" if torch.cuda.is_available() else "peak RSS"
    rows = [
        ("run dir", path),
        (
            "job",
            f"model={cfg.model.name} data={cfg.data.name} strategy={cfg.strategy.name} x{world}{_mesh(cfg, world)} "
            f"ac={cfg.ac.policy} precision={cfg.precision.name}",
        ),
        (
            "steps",
            f"{r.start_step} -> {r.step} of {cfg.trainer.max_steps}"
            + (f" (resumed from {Path(r.resumed_from).name})" if r.resumed_from else "")
            + (" (stopped by signal; rerun the same command to resume)" if r.stopped_by_signal else ""),
        ),
        ("final loss", losses or "-"),
        ("eval loss", f"{r.eval_loss:.4f}" if r.eval_loss is not None else "-"),
        ("time", f"{r.seconds:.1f} s"),
        ("throughput", f"{r.samples_per_s:.0f} samples/s"),
        ("peak memory", f"{r.peak_memory_mib:.0f} MiB (rank 0, {mem_kind})"),
        ("checkpointed", shown or "nothing"),
        ("skipped steps", _skipped(r)),
        ("guards", r.guard),
        (
            "checkpoints",
            f"{len(r.checkpoints)} written, latest {Path(r.checkpoints[-1]).name}" if r.checkpoints else "none",
        ),
        ("metrics", str(Path(path) / "metrics.jsonl")),
        *([("hf weights", str(Path(path) / "hf"))] if (Path(path) / "hf").is_dir() else []),
    ]
    return format_summary(rows)


def _skipped(r: LoopResult) -> str:
    if not r.skipped_steps:
        return "none"
    shown = ", ".join(map(str, r.skipped_steps[:10])) + (", ..." if len(r.skipped_steps) > 10 else "")
    return (
        f"{len(r.skipped_steps)} of {r.step - r.start_step} steps skipped (non-finite loss or gradient norm; "
        f"no update): {shown}"
    )
