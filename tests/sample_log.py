"""Which samples each global step trained on, for the resume tests: a data set of numbered samples, a model
that remembers the numbers of the samples it saw, and a callback that writes them per rank and step.

Launcher form: ``model=custom model._target_=tests.sample_log.IdNet data=custom
data._target_=tests.sample_log.make_ids 'trainer.callbacks=[{_target_:tests.sample_log.LogIds,path:DIR}]'``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

from distckpt._dist import rank_world, unwrap_ddp
from distckpt.train import Callback


class IdFeatures(Dataset):
    """``n`` samples ``{"i": i, "x": features, "y": target}``: ``i`` names the sample."""

    def __init__(self, n: int, dim: int) -> None:
        self.x = torch.randn(n, dim, generator=torch.Generator().manual_seed(7))
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"i": torch.tensor(i), "x": self.x[i], "y": self.y[i]}


def make_ids(n: int = 96, dim: int = 8) -> IdFeatures:
    return IdFeatures(n, dim)


class IdNet(nn.Module):
    """A linear regression that keeps the sample numbers of each forward in ``seen``."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 1)
        self.seen: list[int] = []

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.seen.extend(batch["i"].tolist())
        return {"reg": F.mse_loss(self.fc(batch["x"]), batch["y"])}


class LogIds(Callback):
    """Appends ``{"step", "rank", "world", "launch", "t", "ids"}`` to ``path/ids.rank<r>.jsonl`` after each
    backward (every rank; ``launch``: torchrun's run id)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_after_backward(self, step: int, model: nn.Module) -> None:
        net = unwrap_ddp(model)
        rank, world = rank_world()
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / f"ids.rank{rank}.jsonl", "a") as f:
            launch = os.environ.get("TORCHELASTIC_RUN_ID", "in-process")
            record = {"step": step, "rank": rank, "world": world, "launch": launch, "t": time.time(), "ids": net.seen}
            f.write(json.dumps(record) + "\n")
        net.seen = []


def global_batches(path: Path) -> dict[int, list[int]]:
    """The ids of each global step, the ranks' rows in rank order, from the last launch that ran it (a step
    run again after a kill counts once: as run by the launch that resumed)."""
    runs: dict[int, dict[str, dict[int, list[int]]]] = {}  # step -> launch -> rank -> ids
    last: dict[int, tuple[float, str]] = {}
    for file in sorted(path.glob("ids.rank*.jsonl")):
        for line in file.read_text().splitlines():
            r = json.loads(line)
            runs.setdefault(r["step"], {}).setdefault(r["launch"], {})[r["rank"]] = r["ids"]
            last[r["step"]] = max(last.get(r["step"], (0.0, "")), (r["t"], r["launch"]))
    out = {}
    for step in sorted(runs):
        by_rank = runs[step][last[step][1]]
        out[step] = sum((by_rank[r] for r in sorted(by_rank)), [])
    return out
