"""A user's own two-task model and data set, trained by the launcher with nothing but ``_target_`` overrides:

    torchrun --standalone --nproc_per_node=2 launch/train.py \
        model=custom model._target_=examples.custom.TwoTaskNet +model.width=32 \
        data=custom data._target_=examples.custom.make_dataset +data.n=256 data.batch_size=16 \
        +data.eval.split=eval '+trainer.task_weights={cls: 1.0, reg: 0.5}'

The protocol: the model's ``forward(batch)`` takes the collated batch dict and returns a dict of named
scalar losses (one per task); the data set's items are dicts of tensors.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset


class Features(Dataset):
    """``n`` Gaussian feature vectors with two targets: a class (``y``, argmax of a fixed projection) and a
    number (``z``, the sum of the first four features)."""

    def __init__(self, n: int, dim: int, n_classes: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        proj = torch.randn(dim, n_classes, generator=torch.Generator().manual_seed(12345))  # the task: fixed
        self.x = torch.randn(n, dim, generator=g)
        self.y = (self.x @ proj).argmax(dim=1)
        self.z = self.x[:, :4].sum(dim=1)

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i], "z": self.z[i]}


def make_dataset(n: int = 256, dim: int = 16, n_classes: int = 4, split: str = "train") -> Features:
    """The ``split`` ("train" or "eval") of the two-task data set: the same task, other samples."""
    return Features(n, dim, n_classes, seed=0 if split == "train" else 1)


class Block(nn.Module):
    """A residual MLP block: the unit ``ac=full`` checkpoints and FSDP shards."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.gelu(self.fc(self.norm(h)))


class TwoTaskNet(nn.Module):
    """A trunk of ``depth`` blocks (an ``nn.ModuleList``: distckpt finds them) and two task heads."""

    def __init__(self, dim: int = 16, width: int = 64, depth: int = 2, n_classes: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.cls_head = nn.Linear(width, n_classes)
        self.reg_head = nn.Linear(width, 1)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        h = self.inp(batch["x"])
        for block in self.blocks:
            h = block(h)
        return {
            "cls": F.cross_entropy(self.cls_head(h), batch["y"]),
            "reg": F.mse_loss(self.reg_head(h).squeeze(-1), batch["z"]),
        }
