"""Resumable training checkpoints with ``torch.distributed.checkpoint`` (DCP), written atomically.

Layout: ``RUN_DIR/checkpoints/step_N/`` holds one DCP checkpoint (model, optimizer, scheduler,
grad scaler, step, every rank's data position and RNG state). All ranks write into
``.tmp_step_N``; once DCP has written its ``.metadata`` (after every rank finished), rank 0
writes a manifest (every file's size and CRC32, :mod:`distckpt.train.integrity`) and renames the
folder. A folder named ``step_N`` is therefore complete when written; a crash mid-save leaves only a
``.tmp_*`` folder, which is ignored and removed by the next save. :func:`resume_latest` checks the
manifest, skips a damaged checkpoint for the newest intact one, and refuses one that does not match
the model or optimizer (:func:`check_compatible`).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from distckpt._dist import broadcast_object, rank_world
from distckpt._log import notify
from distckpt.errors import ResumeError
from distckpt.train.integrity import has_manifest, verify_checkpoint, write_manifest

__all__ = ["TrainState", "check_compatible", "latest_checkpoint", "load_checkpoint", "resume_latest", "save_checkpoint"]

_STEP_DIR = re.compile(r"^step_(\d+)$")


def _rank() -> int:
    return rank_world()[0]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch CPU and CUDA, Python)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class TrainState(Stateful):
    """Everything a resume needs, in the form DCP saves and loads (``state_dict``/``load_state_dict``).

    The model and optimizer go through ``torch.distributed.checkpoint.state_dict`` so that DDP,
    FSDP and FSDP2 models all save sharded-aware, FQN-keyed state. The RNG state is per rank, under
    a per-rank key (a resume on another world size keeps the fresh RNG of the missing ranks); so is
    the data loader's position (``data``: any object with ``state_dict``/``load_state_dict``, such as
    ``distckpt.train.data.ShardedLoader``, whose position counts global batches). A rank that the saved
    run did not have loads rank 0's position; the loader decides whether that is exact (map-style data) or
    refused (a stream whose order belongs to the saved layout).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        scaler: Any = None,
        data: Any = None,
    ) -> None:
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.data = data
        self.step = 0  # optimizer steps done

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        sd: dict[str, Any] = {
            "model": model_sd,
            "optim": optim_sd,
            "step": self.step,
            "data": {f"rank{_rank()}": self.data.state_dict() if self.data is not None else {}},
            "rng": {f"rank{_rank()}": rng_state()},
        }
        if self.scheduler is not None:
            # The LR schedule's shape (warmup, total steps) comes from the config, not the checkpoint:
            # a resume with a larger max_steps must stretch the schedule, so LambdaLR's lambdas are not saved.
            sd["scheduler"] = {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}
        if self.scaler is not None:
            sd["scaler"] = self.scaler.state_dict()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        # The configuration wins over the checkpoint for hyperparameters: the optimizer's param-group
        # settings (lr, weight decay, betas, momentum, ...) and the schedule's base lrs and shape are the
        # ones this run was built with; the checkpoint gives the state (weights, moments, step).
        configured = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        for group, settings in zip(self.optimizer.param_groups, configured):
            group.update(settings)
        self.step = int(sd["step"])
        if self.scheduler is not None and "scheduler" in sd:
            _load_schedule_position(self.scheduler, sd["scheduler"])
        if self.scaler is not None and "scaler" in sd:
            self.scaler.load_state_dict(sd["scaler"])
        position = sd.get("data", {}).get(f"rank{_rank()}")  # on a rank the saved run lacked: rank 0's (_LoadView)
        if self.data is not None and position:
            self.data.load_state_dict(position)
        mine = sd["rng"].get(f"rank{_rank()}")
        if isinstance(mine, dict) and isinstance(mine.get("torch"), torch.Tensor):
            set_rng_state(mine)


def _load_schedule_position(scheduler: Any, saved: dict[str, Any]) -> None:
    """Load where the schedule is (``last_epoch``), keep its configured base lrs and lambdas, set the lr."""
    sched = {k: v for k, v in saved.items() if k not in ("base_lrs", "_last_lr")}
    if hasattr(scheduler, "lr_lambdas"):
        sched["lr_lambdas"] = [None] * len(scheduler.lr_lambdas)  # LambdaLR pops it: keep the configured ones
    scheduler.load_state_dict(sched)
    if hasattr(scheduler, "last_epoch") and hasattr(scheduler, "step"):
        # Recompute the lr of this position from the configured base lrs (exact for closed-form schedules
        # such as the launcher's LambdaLR): one step back, then the scheduler's own step. That step also
        # counts itself in the scheduler's bookkeeping (`_step_count` one above the uninterrupted run's,
        # found by comparing a resumed checkpoint with an uninterrupted one entry by entry): put the saved
        # counters back, so the lr is the only thing this recomputation changes.
        counters = {k: v for k, v in sched.items() if k in ("_step_count", "_is_initial", "_get_lr_called_within_step")}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "lr_scheduler.step() before optimizer.step()"
            scheduler.last_epoch -= 1
            scheduler.step()
        scheduler.__dict__.update(counters)


def latest_checkpoint(ckpt_dir: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint with the highest step in ``ckpt_dir``, or ``None``."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return None
    found = [
        (int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and (p / ".metadata").is_file()
    ]
    return max(found)[1] if found else None


def save_checkpoint(state: TrainState, ckpt_dir: str | os.PathLike[str], *, keep_last: int = 0) -> Path:
    """Write ``state`` to ``ckpt_dir/step_{state.step}`` atomically; call it on every rank.

    Args:
        state: what to save.
        ckpt_dir: the run's checkpoint folder (the same path on every rank: a shared file system
            for multi-node runs).
        keep_last: keep only this many newest complete checkpoints (0 keeps all).

    Returns:
        The final folder.
    """
    root = Path(ckpt_dir)
    final = root / f"step_{state.step}"
    tmp = root / f".tmp_step_{state.step}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp_step_*"):  # left by a crash mid-save: never complete
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    with _single_process_quiet():
        dcp.save({"train": state}, checkpoint_id=str(tmp))  # returns once every rank and .metadata are written
    _barrier()
    write_manifest(tmp)  # before the rename: a step_N folder always has its manifest
    if _rank() == 0:
        if final.exists():  # saved again at the same step (a resume that ended where it began)
            shutil.rmtree(final)
        os.replace(tmp, final)
        if keep_last > 0:
            done = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)))
            for _, old in done[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(state: TrainState, path: str | os.PathLike[str]) -> None:
    """Load a checkpoint written by :func:`save_checkpoint` into ``state`` (on every rank).

    Raises:
        ResumeError: the checkpoint's model or optimizer state does not match ``state``'s (see
            :func:`check_compatible`); nothing is loaded then.
    """
    check_compatible(state, path)
    # Partial load: a checkpoint from another world size lacks some ranks' RNG and data entries; everything
    # else was checked to be there above.
    with _single_process_quiet():
        view = _LoadView(state, FileSystemReader(str(path)).read_metadata().state_dict_metadata.keys())
        dcp.load({"train": view}, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True))


class _LoadView(Stateful):
    """``state`` as DCP loads it, reading this rank's data position from rank 0's entry when the saved run had
    no such rank (a resume on more ranks). DCP loads only the keys of the state dict it is given, so the
    position's slot is renamed to the entry to read, and back.

    A map-style loader's position is global, so rank 0's is exact; a stream's loader refuses another layout
    unless told (:meth:`distckpt.train.data.ShardedLoader.load_state_dict`).
    """

    def __init__(self, state: TrainState, saved_keys: Any) -> None:
        self.state, self.own = state, f"rank{_rank()}"
        mine = any(k.startswith(f"train.data.{self.own}.") for k in saved_keys)
        self.source = self.own if mine else "rank0"

    def state_dict(self) -> dict[str, Any]:
        sd = self.state.state_dict()
        sd["data"] = {self.source: sd["data"][self.own]}
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        sd["data"] = {self.own: sd["data"][self.source]}
        self.state.load_state_dict(sd)


# Entries that must match between the checkpoint and the run: weights and optimizer state. The RNG entries
# are per rank (they differ with the world size); the param-group settings come from the config.
_STRICT = ("train.model.", "train.optim.state.")
_SHOWN = 3  # examples per kind of difference


def check_compatible(state: TrainState, path: str | os.PathLike[str]) -> None:
    """Refuse a checkpoint whose model or optimizer keys or shapes differ from ``state``'s.

    Reads only the checkpoint's metadata; every rank comes to the same answer (global shapes), so no
    collective is needed.

    Raises:
        ResumeError: naming the missing, unexpected and reshaped entries (counts and examples) and the
            way out.
    """
    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    planner = DefaultLoadPlanner()  # flattens the state dict into DCP's keys, the ones `meta` uses
    with _single_process_quiet():
        planner.set_up_planner({"train": state.state_dict()}, meta)
    want = {k: v for k, v in planner.state_dict.items() if k.startswith(_STRICT)}
    have = {k: v for k, v in meta.items() if k.startswith(_STRICT)}
    missing, unexpected = sorted(want.keys() - have.keys()), sorted(have.keys() - want.keys())
    reshaped = [
        f"{_short(k)} {list(have[k].size)} in the checkpoint, {list(want[k].size())} now"
        for k in sorted(want.keys() & have.keys())
        if isinstance(have[k], TensorStorageMetadata)
        and isinstance(want[k], torch.Tensor)
        and tuple(have[k].size) != tuple(want[k].size())
    ]
    if not (missing or unexpected or reshaped):
        return
    lines = [
        f"cannot resume from {path}: its model/optimizer state does not match this run's "
        "(a changed model, optimizer or trainable set?)"
    ]
    for label, items in (
        ("missing from the checkpoint", [_short(k) for k in missing]),
        ("in the checkpoint but not in this run", [_short(k) for k in unexpected]),
        ("shape changed", reshaped),
    ):
        if items:
            more = f", ... ({len(items) - _SHOWN} more)" if len(items) > _SHOWN else ""
            lines.append(f"  {label}: {len(items)} ({_by_kind(items)}), e.g. {', '.join(items[:_SHOWN])}{more}")
    lines.append(
        "Start over in this folder with trainer.resume=false (resume=False), or give the changed run "
        "its own folder (hydra.run.dir=...)."
    )
    raise ResumeError("\n".join(lines))


def _short(key: str) -> str:
    return key.removeprefix("train.").replace("optim.state.", "optim.", 1)


def _by_kind(items: list[str]) -> str:
    n_model = sum(i.startswith("model.") for i in items)
    return f"{n_model} model, {len(items) - n_model} optimizer"


def resume_latest(state: TrainState, ckpt_dir: str | os.PathLike[str]) -> Path | None:
    """Load the newest intact checkpoint of ``ckpt_dir`` into ``state``; call it on every rank.

    A damaged one (a file missing, truncated or changed since its manifest was written; an unreadable
    ``.metadata``) is skipped for the next older one, and all skipped are named in one message on rank 0 (the
    ``distckpt`` logger and a warning: :func:`distckpt._log.notify`). Checkpoints without a manifest (older
    distckpt) load with such a message.

    Returns:
        The loaded checkpoint's folder, or ``None`` when ``ckpt_dir`` holds none.

    Raises:
        ResumeError: every checkpoint is damaged (naming the folder), or the newest intact one does
            not match the model/optimizer (see :func:`check_compatible`).
    """
    root = Path(ckpt_dir)
    found = (
        sorted(((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))), reverse=True)
        if _rank() == 0 and root.is_dir()
        else []
    )
    candidates = [Path(p) for p in broadcast_object([str(p) for _, p in found])]
    skipped: list[str] = []
    for path in candidates:
        problems = verify_checkpoint(path) or _metadata_problem(path)
        if problems:
            skipped.append(f"{path.name} ({'; '.join(problems[:2])})")
            continue
        if _rank() == 0 and (skipped or not has_manifest(path)):
            note = f"skipped damaged checkpoints: {', '.join(skipped)}; " if skipped else ""
            unchecked = "" if has_manifest(path) else " (it has no manifest: written by an older distckpt, unchecked)"
            notify(f"{note}resuming from {path}{unchecked}", stacklevel=2)
        load_checkpoint(state, path)
        return path
    if skipped:
        raise ResumeError(
            f"no intact checkpoint in {root}: {', '.join(skipped)}. Move the damaged folders "
            "away, or start over with trainer.resume=false or a new hydra.run.dir."
        )
    return None


def _metadata_problem(path: Path) -> list[str]:
    """``.metadata`` missing or unreadable (for checkpoints without a manifest, and a manifest's blind spots)."""
    try:
        FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # truncated pickle, missing file: anything DCP cannot read is damage here
        return [f".metadata is unreadable ({type(e).__name__})"]
    return []


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    # Without a process group DCP warns on every call that it assumes one process: that is the intent here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
