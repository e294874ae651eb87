"""Where training metrics go: metrics.jsonl always, TensorBoard and wandb when asked (rank 0 only).

TensorBoard and wandb are imported only when enabled, so the library needs nothing but torch.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["MetricSink", "peak_memory_mib", "format_summary"]


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this process so far, in MiB: allocated CUDA memory, or the peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is KiB on Linux and bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


class MetricSink:
    """Writes one record per logged step to every enabled backend.

    Args:
        run_dir: the run folder; ``metrics.jsonl`` (appended to across resumes) and the
            TensorBoard events go there.
        tensorboard: also write TensorBoard events under ``run_dir/tb``.
        wandb_mode: ``None`` (off), ``"online"``, ``"offline"`` or ``"disabled"``. ``"online"``
            without an API key falls back to offline, so a run never prompts or waits for a login.
        wandb_project: the wandb project name.
        config: the resolved run configuration, logged to wandb.
        enabled: ``False`` on ranks other than 0 (every call is then a no-op).
    """

    def __init__(self, run_dir: str | os.PathLike[str], *, tensorboard: bool = False, wandb_mode: str | None = None,
                 wandb_project: str = "distckpt", config: dict[str, Any] | None = None, enabled: bool = True) -> None:
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - closed in close()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"))
        if wandb_mode and wandb_mode != "disabled":
            self._wandb = _start_wandb(self.run_dir, wandb_mode, wandb_project, config or {})

    def log(self, record: dict[str, Any]) -> None:
        """Write ``record`` (it must hold ``step``)."""
        if not self.enabled:
            return
        assert self._jsonl is not None
        self._jsonl.write(json.dumps(record) + "\n")
        step = int(record["step"])
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._jsonl = self._tb = self._wandb = None


def _start_wandb(run_dir: Path, mode: str, project: str, config: dict[str, Any]) -> Any:
    import wandb  # needs the wandb package (extra "launch")

    mode = os.environ.get("WANDB_MODE", mode)  # the user's environment wins (offline on a cluster, ...)
    if mode == "online" and not (os.environ.get("WANDB_API_KEY") or _wandb_logged_in()):
        warnings.warn("wandb: no API key (WANDB_API_KEY or `wandb login`); logging offline to the run dir. "
                      "Sync later with `wandb sync RUN_DIR/wandb`.", stacklevel=3)
        mode = "offline"
    # The run id lives in the run dir, so a resumed run continues the same wandb run.
    id_file = run_dir / "wandb_id.txt"
    run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
    id_file.write_text(run_id)
    return wandb.init(project=project, id=run_id, resume="allow", dir=str(run_dir), mode=mode, config=config,
                      settings=wandb.Settings(console="off", silent=True, init_timeout=60))


def _wandb_logged_in() -> bool:
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def format_summary(rows: list[tuple[str, Any]], title: str = "distckpt run summary") -> str:
    """A one-screen table of ``(name, value)`` rows."""
    width = max(len(k) for k, _ in rows)
    lines = [title, "-" * max(len(title), 40)]
    lines += [f"{k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)


class Stopwatch:
    """Samples per second over the steps since the last ``lap``."""

    def __init__(self) -> None:
        self.start = self._last = time.perf_counter()
        self._samples = 0

    def add(self, samples: int) -> None:
        self._samples += samples

    def lap(self) -> float:
        now = time.perf_counter()
        rate = self._samples / max(now - self._last, 1e-9)
        self._last, self._samples = now, 0
        return rate
