"""Resumable training checkpoints with ``torch.distributed.checkpoint`` (DCP), written atomically.

Layout: ``RUN_DIR/checkpoints/step_N/`` holds one DCP checkpoint (model, optimizer, scheduler,
grad scaler, step, every rank's data position and RNG state). All ranks write into
``.tmp_step_N``; once DCP has written its ``.metadata`` (after every rank finished), rank 0
renames the folder. A folder named ``step_N`` is therefore always complete; a crash mid-save leaves
only a ``.tmp_*`` folder, which is ignored and removed by the next save.
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
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from distckpt._dist import rank_world

__all__ = ["TrainState", "latest_checkpoint", "load_checkpoint", "save_checkpoint"]

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
    ``distckpt.train.data.ShardedLoader``, whose position counts global batches).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None,
                 scaler: Any = None, data: Any = None) -> None:
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
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.step = int(sd["step"])
        if self.scheduler is not None and "scheduler" in sd:
            sched = dict(sd["scheduler"])
            if hasattr(self.scheduler, "lr_lambdas"):
                sched["lr_lambdas"] = [None] * len(self.scheduler.lr_lambdas)  # keep the configured ones
            self.scheduler.load_state_dict(sched)
        if self.scaler is not None and "scaler" in sd:
            self.scaler.load_state_dict(sd["scaler"])
        position = sd.get("data", {}).get(f"rank{_rank()}")
        if self.data is not None and position:
            self.data.load_state_dict(position)
        mine = sd["rng"].get(f"rank{_rank()}")
        if isinstance(mine, dict) and isinstance(mine.get("torch"), torch.Tensor):
            set_rng_state(mine)


def latest_checkpoint(ckpt_dir: str | os.PathLike[str]) -> Path | None:
    """The complete checkpoint with the highest step in ``ckpt_dir``, or ``None``."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / ".metadata").is_file()]
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
    """Load a checkpoint written by :func:`save_checkpoint` into ``state`` (on every rank)."""
    # Partial load: a checkpoint from another world size lacks some ranks' RNG entries.
    with _single_process_quiet():
        dcp.load({"train": state}, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True))


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    # Without a process group DCP warns on every call that it assumes one process: that is the intent here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
