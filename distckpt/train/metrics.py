"""Where training metrics go: metrics.jsonl always, plus the writers the launcher passes (rank 0 only).

TensorBoard and wandb writers live in ``launch/loggers.py``, so the library needs nothing but torch.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

__all__ = ["MetricSink", "MetricWriter", "peak_memory_mib", "format_summary"]


def peak_memory_mib(device: torch.device) -> float:
    """Peak memory of this process so far, in MiB: allocated CUDA memory, or the peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is KiB on Linux and bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**20 if sys.platform == "darwin" else 2**10)


class MetricWriter(Protocol):
    """A metrics backend (TensorBoard, wandb, ...): the launcher makes them, the sink feeds them."""

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class MetricSink:
    """Writes one record per logged step to ``metrics.jsonl`` and to every extra writer.

    Args:
        run_dir: the run folder; ``metrics.jsonl`` is appended to across resumes.
        writers: extra backends, each with ``log(scalars, step)`` and ``close()`` (the launcher's
            TensorBoard and wandb writers in ``launch/loggers.py``: the library imports neither).
        enabled: ``False`` on ranks other than 0 (every call is then a no-op).
    """

    def __init__(
        self, run_dir: str | os.PathLike[str], *, writers: Sequence[MetricWriter] = (), enabled: bool = True
    ) -> None:
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._jsonl = None
        self._writers: list[MetricWriter] = list(writers) if enabled else []
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 - closed in close()

    def log(self, record: dict[str, Any]) -> None:
        """Write ``record`` (it must hold ``step``)."""
        if not self.enabled:
            return
        assert self._jsonl is not None
        self._jsonl.write(json.dumps(record) + "\n")
        step = int(record["step"])
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        for w in self._writers:
            w.log(scalars, step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        for w in self._writers:
            w.close()
        self._jsonl, self._writers = None, []


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
