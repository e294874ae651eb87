"""Multi-task training data that is a pure function of (seed, step): resumable and rank-consistent.

Each step has one *global* batch, made from a generator seeded with ``(seed, step)``; rank ``r`` of
``W`` takes rows ``[r*B/W, (r+1)*B/W)`` and splits them into micro-batches. So a run on W ranks sees
exactly the data of a single-process run with the same global batch, and the data position after
a resume is just the step number (no iterator state to save).
"""

from __future__ import annotations

from typing import Protocol

import torch

from distckpt.errors import ConfigError

__all__ = ["DigitsData", "StepData", "SyntheticMLPData", "SyntheticTokens", "micro_batches"]

Batch = dict[str, torch.Tensor]


class StepData(Protocol):
    """What the loop needs from a data source."""

    batch_size: int

    def global_batch(self, step: int) -> Batch: ...

    def eval_batch(self) -> Batch: ...


def _gen(seed: int, step: int) -> torch.Generator:
    # Distinct, reproducible streams per step; 1_000_003 is prime so (seed, step) pairs do not collide
    # for any realistic run length.
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def micro_batches(batch: Batch, rank: int, world_size: int, n_micro: int) -> list[Batch]:
    """This rank's share of a global batch, as ``n_micro`` equal micro-batches.

    Raises:
        ConfigError: the global batch does not split evenly.
    """
    n = next(iter(batch.values())).shape[0]
    if n % (world_size * n_micro):
        raise ConfigError(
            f"data.batch_size={n} does not split into {world_size} ranks x {n_micro} micro-batches; "
            f"set data.batch_size to a multiple of {world_size * n_micro}."
        )
    per_rank = n // world_size
    mine = {k: v[rank * per_rank:(rank + 1) * per_rank] for k, v in batch.items()}
    size = per_rank // n_micro
    return [{k: v[i * size:(i + 1) * size] for k, v in mine.items()} for i in range(n_micro)]


class SyntheticTokens:
    """Token sequences ``x_t = (x_0 + a*t) mod V`` with a little noise; the class is the stride ``a``.

    Task ``lm`` learns the progression, task ``cls`` learns its stride: both are learnable, so the
    loss visibly drops within a few hundred steps of a tiny model.
    """

    def __init__(self, batch_size: int, seq_len: int, vocab_size: int, n_classes: int, seed: int = 0,
                 noise: float = 0.05) -> None:
        self.batch_size, self.seq_len, self.vocab_size, self.n_classes = batch_size, seq_len, vocab_size, n_classes
        self.seed, self.noise = seed, noise

    def _make(self, g: torch.Generator, n: int) -> Batch:
        x0 = torch.randint(self.vocab_size, (n, 1), generator=g)
        label = torch.randint(self.n_classes, (n,), generator=g)
        t = torch.arange(self.seq_len)
        tokens = (x0 + (label[:, None] + 1) * t) % self.vocab_size
        noisy = torch.rand(n, self.seq_len, generator=g) < self.noise
        tokens = torch.where(noisy, torch.randint(self.vocab_size, (n, self.seq_len), generator=g), tokens)
        return {"tokens": tokens, "label": label}

    def global_batch(self, step: int) -> Batch:
        return self._make(_gen(self.seed, step), self.batch_size)

    def eval_batch(self) -> Batch:
        return self._make(_gen(self.seed + 7919, 0), self.batch_size)


class SyntheticMLPData:
    """Gaussian features; task ``a`` is the argmax of a fixed random projection, task ``b`` a sign pattern."""

    def __init__(self, batch_size: int, in_features: int, n_classes_a: int, seed: int = 0) -> None:
        self.batch_size, self.in_features, self.seed = batch_size, in_features, seed
        self.proj = torch.randn(in_features, n_classes_a, generator=torch.Generator().manual_seed(seed + 1))

    def _make(self, g: torch.Generator, n: int) -> Batch:
        x = torch.randn(n, self.in_features, generator=g)
        return {"x": x, "y_a": (x @ self.proj).argmax(dim=1), "y_b": (x[:, 0] * x[:, 1] > 0).long()}

    def global_batch(self, step: int) -> Batch:
        return self._make(_gen(self.seed, step), self.batch_size)

    def eval_batch(self) -> Batch:
        return self._make(_gen(self.seed + 7919, 0), self.batch_size)


class DigitsData:
    """scikit-learn's bundled 8x8 digits (no download) as two tasks: ``a`` the digit, ``b`` its parity.

    The last ``n_eval`` images are held out for evaluation; each step samples its batch (with
    replacement) from the rest with the step's generator.
    """

    in_features = 64
    n_classes_a = 10

    def __init__(self, batch_size: int, seed: int = 0, n_eval: int = 297) -> None:
        from sklearn.datasets import load_digits  # optional dependency (extra "launch")

        d = load_digits()
        x = torch.tensor(d.data, dtype=torch.float32) / 16.0
        y = torch.tensor(d.target, dtype=torch.long)
        self.x, self.y = x[:-n_eval], y[:-n_eval]
        self.x_eval, self.y_eval = x[-n_eval:], y[-n_eval:]
        self.batch_size, self.seed = batch_size, seed

    @staticmethod
    def _pack(x: torch.Tensor, y: torch.Tensor) -> Batch:
        return {"x": x, "y_a": y, "y_b": y % 2}

    def global_batch(self, step: int) -> Batch:
        idx = torch.randint(self.x.shape[0], (self.batch_size,), generator=_gen(self.seed, step))
        return self._pack(self.x[idx], self.y[idx])

    def eval_batch(self) -> Batch:
        return self._pack(self.x_eval, self.y_eval)
