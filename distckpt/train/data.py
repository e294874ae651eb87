"""Data loading for the training loop: one ``DataLoader`` per rank, sharded, shuffled per epoch, resumable.

A data set is either map-style (``len`` and ``ds[i]``, items are dicts of tensors) or an
``IterableDataset``. :class:`ShardedLoader` cuts it into *global* batches of ``batch_size`` samples
(the same global batch on any number of ranks: epoch ``e``'s permutation, seeded with ``seed + e``,
taken ``batch_size`` at a time) and gives rank ``r`` of ``W`` rows ``[r*B/W, (r+1)*B/W)`` of each.
So a run on W ranks reads exactly the samples of a single-process run with the same global batch,
and each rank reads only its own samples (map-style; an iterable stream is read by every rank and
worker, which keep their part).

Its position is two integers, ``(epoch, batch)``: the global batches consumed in the current epoch.
``TrainState`` saves it per rank in the DCP checkpoint, and a resume restarts the sampler at that
batch. Why not torchdata's ``StatefulDataLoader`` (0.11 works with torch 2.13, checked): this loop
must run with torch alone (tests/launch/test_train_torch_only.py), its
``StatefulDistributedSampler`` neither saves the epoch nor lays the ranks out as slices of one global
batch, and for a sampler that is a function of ``(seed, epoch)`` the two integers restart it exactly,
with no replay of the consumed batches.
"""

from __future__ import annotations

import itertools
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, default_collate

from distckpt._dist import rank_world
from distckpt._log import notify
from distckpt.errors import ConfigError, ResumeError
from distckpt.train.streams import RankShard, StreamReaders, can_shard, open_reader, reader_collate

__all__ = [
    "DictDataset",
    "GlobalBatchSampler",
    "ShardedLoader",
    "TaskBatches",
    "TaskMixLoader",
    "TokenWindows",
    "digits",
    "micro_batches",
    "synthetic_mlp",
    "synthetic_tokens",
]

Batch = dict[str, torch.Tensor]


class TaskBatches(dict):
    """One batch per task (``{task: batch}``): the loop runs one forward per task batch, then one backward."""


def micro_batches(batch: Batch, rank: int, world_size: int, n_micro: int) -> list[Batch]:
    """Rank ``rank``'s share of ``batch`` as ``n_micro`` equal micro-batches (``world_size=1``: all of it).
    A :class:`TaskBatches` splits task by task.

    Raises:
        ConfigError: the batch does not split evenly.
    """
    if isinstance(batch, TaskBatches):
        per_task = {t: micro_batches(b, rank, world_size, n_micro) for t, b in batch.items()}
        return [TaskBatches({t: parts[i] for t, parts in per_task.items()}) for i in range(n_micro)]
    n = next(iter(batch.values())).shape[0]
    if n % (world_size * n_micro):
        raise ConfigError(
            f"a batch of {n} does not split into {world_size} ranks x {n_micro} micro-batches; "
            f"set data.batch_size to a multiple of {world_size * n_micro}."
        )
    per_rank = n // world_size
    mine = {k: v[rank * per_rank : (rank + 1) * per_rank] for k, v in batch.items()}
    size = per_rank // n_micro
    return [{k: v[i * size : (i + 1) * size] for k, v in mine.items()} for i in range(n_micro)]


class DictDataset(Dataset):
    """A map-style data set over tensors of equal length: item ``i`` is ``{k: v[i]}``."""

    def __init__(self, tensors: Batch) -> None:
        lengths = {v.shape[0] for v in tensors.values()}
        if len(lengths) != 1:
            raise ConfigError(f"DictDataset tensors have different lengths {sorted(lengths)}; give equal lengths.")
        self.tensors = tensors

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def __getitem__(self, i: int) -> Batch:
        return {k: v[i] for k, v in self.tensors.items()}


class GlobalBatchSampler(Sampler[list[int]]):
    """This rank's indices of each global batch of a map-style data set, for one epoch, from batch ``start``.

    Epoch ``e`` orders the ``n`` samples by ``randperm(n)`` seeded with ``seed + e`` (or in order without
    shuffling); global batch ``k`` is positions ``[k*B, (k+1)*B)`` of that order and this rank takes its
    contiguous slice. ``drop_last`` drops a last incomplete global batch; otherwise it is filled from the
    start of the order (as ``DistributedSampler`` pads), so every rank has the same number of batches.
    """

    def __init__(
        self,
        n: int,
        batch_size: int,
        *,
        rank: int,
        world_size: int,
        shuffle: bool,
        seed: int,
        drop_last: bool,
        epoch: int = 0,
        start: int = 0,
    ) -> None:
        if batch_size % world_size:
            raise ConfigError(f"data.batch_size={batch_size} must be a multiple of the {world_size} ranks.")
        self.n, self.batch_size, self.rank, self.world_size = n, batch_size, rank, world_size
        self.shuffle, self.seed, self.drop_last, self.epoch, self.start = shuffle, seed, drop_last, epoch, start

    def __len__(self) -> int:
        full, rest = divmod(self.n, self.batch_size)
        return full + (bool(rest) and not self.drop_last) - self.start

    def order(self) -> torch.Tensor:
        """The epoch's sample order, padded to whole global batches."""
        if self.shuffle:
            order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(self.n)
        want = (len(self) + self.start) * self.batch_size
        return order.repeat(-(-want // self.n))[:want] if want > self.n else order[:want]

    def __iter__(self) -> Iterator[list[int]]:
        order, b = self.order(), self.batch_size // self.world_size
        for k in range(self.start, self.start + len(self)):
            yield order[k * self.batch_size + self.rank * b : k * self.batch_size + (self.rank + 1) * b].tolist()


# What a data set without a shard hook costs, said once at start (docs/launcher.md, "Real data").
REPLAY_COST = (
    "data: {name} is an IterableDataset without state_dict()/load_state_dict() and a shard hook, so every rank "
    "and DataLoader worker reads all of it ({readers} reads of each sample per epoch) and a resume replays the "
    "epoch up to its position (time grows with the position). Give it state_dict(), load_state_dict() and "
    "shard(rank, world_size, worker, num_workers), or use a datasets.IterableDataset (docs/launcher.md, Real data)."
)


class ShardedLoader:
    """One rank's endless loader over a data set: epochs one after another, resumable at ``(epoch, batch)``.

    Three kinds of data set (``self.kind``):

    - ``"map"``: a map-style data set, read through :class:`GlobalBatchSampler`. Its position is global (the
      same on every rank), so it resumes exactly on any number of ranks.
    - ``"shards"``: a shardable stream (:func:`distckpt.train.streams.can_shard`): each rank and worker reads
      its own part and resumes from its saved state.
    - ``"replay"``: any other ``IterableDataset``, read whole by every rank and worker and replayed on resume
      (one warning at start names the cost).

    A stream's order depends on the readers' layout (ranks x workers): resuming one on another layout raises
    a :class:`ResumeError` unless ``allow_reshuffle``.

    Args:
        dataset: a map-style data set of dicts of tensors, or an ``IterableDataset`` (if it has
            ``set_epoch(e)``, it is called at each epoch start).
        batch_size: the global batch (all ranks together); each rank gets ``batch_size / world``.
        shuffle: a new seeded permutation per epoch (map-style only).
        seed: the shuffling seed (and the DataLoader workers' base seed).
        num_workers, pin_memory: as ``torch.utils.data.DataLoader``.
        drop_last: drop an incomplete last global batch (iterable streams always do).
        eval_dataset: the eval split, read in order, sharded the same way; ``None``: no evaluation.
        rank, world_size: default: this process's rank and the group's size.
        allow_reshuffle: resume a stream saved on another layout anyway, at its global position (samples may
            repeat or be skipped).

    Raises:
        ConfigError: the batch does not split over the ranks, or an epoch has no complete batch.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
        drop_last: bool = True,
        eval_dataset: Dataset | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        allow_reshuffle: bool = False,
    ) -> None:
        r, w = rank_world()
        self.rank, self.world_size = r if rank is None else rank, w if world_size is None else world_size
        if batch_size % self.world_size:
            raise ConfigError(f"data.batch_size={batch_size} must be a multiple of the {self.world_size} ranks.")
        self.dataset, self.eval_dataset, self.batch_size = dataset, eval_dataset, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.num_workers, self.pin_memory, self.allow_reshuffle = num_workers, pin_memory, allow_reshuffle
        self.epoch, self.batch = 0, 0  # the position: global batches consumed in this epoch
        self._it: Iterator[Any] | None = None
        if not isinstance(dataset, IterableDataset):
            self.kind = "map"
        else:
            self.kind = "shards" if can_shard(dataset) else "replay"
        self._readers = StreamReaders(max(num_workers, 1)) if self.kind == "shards" else None
        if self.kind == "replay" and self.rank == 0:
            readers = self.world_size * max(num_workers, 1)
            warnings.warn(REPLAY_COST.format(name=type(dataset).__name__, readers=readers), stacklevel=2)

    def _common(self, epoch: int) -> dict[str, Any]:
        # A generator of our own: without one, each new iterator draws its workers' base seed from the
        # global torch RNG, so a resumed run's dropout stream would differ from an uninterrupted one.
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) * 1009 + self.rank)
        return dict(num_workers=self.num_workers, pin_memory=self.pin_memory, generator=gen)

    def _loader(self, dataset: Dataset, *, epoch: int, start: int, shuffle: bool, drop_last: bool) -> DataLoader:
        if isinstance(dataset, IterableDataset):
            if hasattr(dataset, "set_epoch"):
                dataset.set_epoch(epoch)
            if dataset is self.dataset and self._readers is not None:
                per_rank = self.batch_size // self.world_size
                readers = self._readers.dataset(dataset, per_rank, self.rank, self.world_size)
                return DataLoader(readers, batch_size=None, collate_fn=reader_collate, **self._common(epoch))
            shard = RankShard(dataset, self.batch_size, self.rank, self.world_size, skip=start)
            return DataLoader(shard, batch_size=self.batch_size // self.world_size, **self._common(epoch))
        sampler = GlobalBatchSampler(
            len(dataset),
            self.batch_size,
            rank=self.rank,
            world_size=self.world_size,
            shuffle=shuffle,
            seed=self.seed,
            drop_last=drop_last,
            epoch=epoch,
            start=start,
        )
        return DataLoader(dataset, batch_sampler=sampler, **self._common(epoch))

    def next_batch(self) -> Batch:
        """This rank's part of the next global batch (a new epoch starts when one ends)."""
        for _ in range(2):
            if self._it is None:
                self._it = iter(
                    self._loader(
                        self.dataset, epoch=self.epoch, start=self.batch, shuffle=self.shuffle, drop_last=self.drop_last
                    )
                )
            batch = self._readers.take(self._it) if self._readers is not None else next(self._it, None)
            if batch is not None:
                self.batch += 1
                return batch
            self.epoch, self.batch, self._it = self.epoch + 1, 0, None
            if self._readers is not None:
                self._readers.reset()
        raise ConfigError(
            f"the data set has no complete global batch of data.batch_size={self.batch_size}; "
            "lower data.batch_size or give more samples."
        )

    def eval_batches(self) -> Iterator[Batch]:
        """This rank's part of every global batch of the eval split, in order (the last one padded)."""
        if self.eval_dataset is None:
            return iter(())
        return iter(self._loader(self.eval_dataset, epoch=0, start=0, shuffle=False, drop_last=False))

    def example(self, n_micro: int = 1) -> Batch:
        """One micro-batch of this rank's size from the data set's first samples, without moving the position."""
        size = self.batch_size // self.world_size // n_micro
        if self.kind == "shards":  # the whole stream as one reader's part
            return default_collate(list(itertools.islice(iter(open_reader(self.dataset, 0, 1, 0, 1)), size)))
        if isinstance(self.dataset, IterableDataset):
            return default_collate(list(itertools.islice(iter(self.dataset), size)))
        return default_collate([self.dataset[i] for i in range(size)])

    def state_dict(self) -> dict[str, Any]:
        """The position: ``epoch``, ``batch`` (global batches taken in the epoch) and ``world_size``; a shardable
        stream adds its readers' states (``readers``: pickled bytes, one opaque checkpoint entry)."""
        sd: dict[str, Any] = {"epoch": self.epoch, "batch": self.batch, "world_size": self.world_size}
        if self._readers is not None:
            sd["readers"] = pickle.dumps(self._readers.state_dict())
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Continue at a saved position (this rank's own, or, on another world size, any rank's).

        Raises:
            ResumeError: a stream saved on another layout (ranks x workers), without ``allow_reshuffle``.
        """
        self.epoch, self.batch, self._it = int(sd["epoch"]), int(sd["batch"]), None
        if self.kind == "map":
            return  # a global position: the same samples follow on any number of ranks
        saved_world = int(sd.get("world_size", self.world_size))
        saved = pickle.loads(sd["readers"]) if self._readers is not None and sd.get("readers") else None
        saved_workers = saved["workers"] if saved is not None else max(self.num_workers, 1)
        moved = saved_world != self.world_size or (self._readers is not None and saved_workers != self._readers.n)
        if moved:
            self._refuse_or_warn(saved_world, saved_workers)
        if self._readers is not None:
            if moved or saved is None:
                self._readers.skip_consumed(self.batch)
            else:
                self._readers.load_state_dict(saved)

    def _refuse_or_warn(self, saved_world: int, saved_workers: int) -> None:
        name = type(self.dataset).__name__
        layout = f"{saved_world} ranks x {saved_workers} workers"
        now = f"{self.world_size} ranks x {max(self.num_workers, 1)} workers"
        why = (
            "its readers' saved states belong to that layout"
            if self.kind == "shards"
            else "an IterableDataset without state and a shard hook may yield other items on another world size"
        )
        if not self.allow_reshuffle:
            raise ResumeError(
                f"cannot resume the {name} stream saved on {layout} on {now} in the same order ({why}); resume on "
                f"{layout} (data.num_workers={saved_workers}), or set trainer.allow_reshuffle=true to continue anyway."
            )
        if self.rank == 0:
            notify(
                f"trainer.allow_reshuffle: the {name} stream saved on {layout} continues on {now} by replaying "
                f"{self.batch} batches of epoch {self.epoch}; samples may repeat or be skipped.",
                stacklevel=3,
            )


class TaskMixLoader:
    """Per-task loaders mixed by sampling weight: each global batch has ``batch_size * w_t / sum(w)`` samples
    of task ``t``, as a :class:`TaskBatches`. Each task's loader is sharded, shuffled and resumed on its own
    (a task's epoch ends when its data set is used up, independently of the others).

    Args:
        datasets: ``{task: (train_set, eval_set or None)}``.
        weights: ``{task: sampling weight}``, the same keys.
        batch_size: the global batch of all tasks together.
        kwargs: the :class:`ShardedLoader` options (``seed`` is offset per task, so tasks shuffle apart).

    Raises:
        ConfigError: a task's share is not a whole multiple of the ranks, or the weights are not positive.
    """

    def __init__(
        self,
        datasets: dict[str, tuple[Dataset, Dataset | None]],
        weights: dict[str, float],
        batch_size: int,
        *,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        if set(weights) != set(datasets) or any(w <= 0 for w in weights.values()):
            raise ConfigError(f"data.tasks needs a positive weight for each task; got {weights}.")
        total = sum(weights.values())
        self.batch_size, self.loaders = batch_size, {}
        for i, (task, (train_set, eval_set)) in enumerate(sorted(datasets.items())):
            share = batch_size * weights[task] / total
            if share != int(share) or share < 1:
                raise ConfigError(
                    f"data.tasks.{task}.weight={weights[task]} gives {share:g} of data.batch_size="
                    f"{batch_size} samples; choose weights that split the batch into whole parts."
                )
            self.loaders[task] = ShardedLoader(
                train_set, int(share), seed=seed + 1009 * i, eval_dataset=eval_set, **kwargs
            )

    def next_batch(self) -> TaskBatches:
        return TaskBatches({t: ld.next_batch() for t, ld in self.loaders.items()})

    def eval_batches(self) -> Iterator[TaskBatches]:
        """Each task's eval batches, zipped (stops at the shortest split; tasks without one are left out)."""
        with_eval = {t: ld.eval_batches() for t, ld in self.loaders.items() if ld.eval_dataset is not None}
        if not with_eval:
            return iter(())
        return (TaskBatches(zip(with_eval, group)) for group in zip(*with_eval.values()))

    def example(self, n_micro: int = 1) -> TaskBatches:
        return TaskBatches({t: ld.example(n_micro) for t, ld in self.loaders.items()})

    def state_dict(self) -> dict[str, Any]:
        return {t: ld.state_dict() for t, ld in self.loaders.items()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for t, ld in self.loaders.items():
            ld.load_state_dict(sd[t])


# --- built-in data sets -------------------------------------------------------------------------------
TOKEN_DTYPES = ("uint16", "uint32")


class TokenWindows(Dataset):
    """A flat binary file of token ids (nanoGPT's ``train.bin``) as consecutive windows of ``seq_len`` tokens.

    The file is opened with ``numpy.memmap`` in each process that reads it (DataLoader workers
    included) and never loaded whole; item ``i`` is ``{"tokens": ids[i*seq_len:(i+1)*seq_len]}`` as int64.

    Args:
        path: the file; its size must be a multiple of the dtype's size.
        seq_len: tokens per window (the model's ``seq_len``); a last partial window is dropped.
        dtype: ``"uint16"`` (nanoGPT's default, vocabularies up to 65536) or ``"uint32"``.
        vocab_size: if given, every id must be below it (checked once, with one pass over the file).
        vocab_of: what ``vocab_size`` is the vocabulary of, when it is fixed (``"model.pretrained=DIR"``):
            the error then asks for another file, not a larger ``model.vocab_size``.

    Raises:
        ConfigError: a missing or ill-sized file, a bad dtype, no complete window, or an id out of range.
    """

    def __init__(
        self,
        path: str,
        seq_len: int,
        dtype: str = "uint16",
        vocab_size: int | None = None,
        *,
        vocab_of: str | None = None,
    ) -> None:
        import numpy as np  # torch's optional numpy; needed for memory-mapped token files only

        if dtype not in TOKEN_DTYPES:
            raise ConfigError(f"data.dtype={dtype!r} is not one of {', '.join(TOKEN_DTYPES)}.")
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"token file {path} does not exist; write one with scripts/make_tokens.py.")
        size, itemsize = file.stat().st_size, np.dtype(dtype).itemsize
        if size % itemsize:
            raise ConfigError(
                f"token file {path} has {size} bytes, not a multiple of {itemsize} ({dtype}); is data.dtype right?"
            )
        self.path, self.seq_len, self.dtype = str(file), seq_len, dtype
        self.n_tokens = size // itemsize
        if self.n_tokens < seq_len:
            raise ConfigError(
                f"token file {path} has {self.n_tokens} tokens, fewer than one window of model.seq_len={seq_len}."
            )
        self._ids: Any = None
        if vocab_size is not None and (top := int(self._memmap().max())) >= vocab_size:
            if vocab_of is not None:  # a pretrained vocabulary cannot grow: the file is the one to change
                raise ConfigError(
                    f"token file {path} has token id {top} >= {vocab_size}, the vocabulary of {vocab_of}; "
                    f"write the file with that model's tokenizer (scripts/make_tokens.py --tokenizer DIR)."
                )
            raise ConfigError(
                f"token file {path} has token id {top} >= model.vocab_size={vocab_size}; "
                f"set model.vocab_size={top + 1} or more (or check data.dtype)."
            )

    def _memmap(self) -> Any:
        import numpy as np

        if self._ids is None:
            self._ids = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))
        return self._ids

    def __getstate__(self) -> dict[str, Any]:  # to DataLoader workers: each opens the file itself
        return {**self.__dict__, "_ids": None}

    def __len__(self) -> int:
        return self.n_tokens // self.seq_len

    def __getitem__(self, i: int) -> Batch:
        if not 0 <= i < len(self):
            raise IndexError(i)
        window = self._memmap()[i * self.seq_len : (i + 1) * self.seq_len]
        return {"tokens": torch.from_numpy(window.astype("int64"))}


def synthetic_tokens(
    n: int, seq_len: int, vocab_size: int, n_classes: int, seed: int = 0, noise: float = 0.05
) -> DictDataset:
    """``n`` token sequences ``x_t = (x_0 + a*t) mod V`` with a little noise; the class is the stride ``a``.

    Task ``lm`` learns the progression, task ``cls`` its stride: both learnable by a tiny model.
    """
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randint(vocab_size, (n, 1), generator=g)
    label = torch.randint(n_classes, (n,), generator=g)
    tokens = (x0 + (label[:, None] + 1) * torch.arange(seq_len)) % vocab_size
    noisy = torch.rand(n, seq_len, generator=g) < noise
    tokens = torch.where(noisy, torch.randint(vocab_size, (n, seq_len), generator=g), tokens)
    return DictDataset({"tokens": tokens, "label": label})


def synthetic_mlp(n: int, in_features: int, n_classes_a: int, seed: int = 0) -> DictDataset:
    """Gaussian features; task ``a`` is the argmax of a fixed random projection (of ``seed``), ``b`` a sign pattern."""
    proj = torch.randn(in_features, n_classes_a, generator=torch.Generator().manual_seed(1))
    x = torch.randn(n, in_features, generator=torch.Generator().manual_seed(seed))
    return DictDataset({"x": x, "y_a": (x @ proj).argmax(dim=1), "y_b": (x[:, 0] * x[:, 1] > 0).long()})


DIGITS_FEATURES = 64


def digits(split: str = "train", n_eval: int = 297) -> DictDataset:
    """scikit-learn's bundled 8x8 digits (no download): task ``a`` the digit, ``b`` its parity.

    The last ``n_eval`` images are the ``"eval"`` split, the rest ``"train"``.
    """
    from sklearn.datasets import load_digits  # optional dependency (extra "launch")

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    part = slice(-n_eval, None) if split == "eval" else slice(None, -n_eval)
    return DictDataset({"x": x[part], "y_a": y[part], "y_b": y[part] % 2})
