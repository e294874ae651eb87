"""Iterable (streamed) data sets for :class:`~distckpt.train.data.ShardedLoader`: read in part by each rank
and DataLoader worker when the data set can shard itself and save its position, replayed whole otherwise.

A *shardable* stream is an ``IterableDataset`` with ``state_dict()`` / ``load_state_dict(sd)`` and a shard
hook: either a Hugging Face ``datasets.IterableDataset`` (split with ``datasets.distributed.
split_dataset_by_node`` over ranks x workers) or any object with a method

    ``shard(rank, world_size, worker, num_workers) -> reader``

returning the part that reader ``(rank, worker)`` reads, itself iterable and with ``state_dict()`` (the
position after the items its iterator yielded so far) and ``load_state_dict(sd)`` (continue from there). Each
reader yields whole per-rank batches of its own items; a batch travels from its worker with the reader's
state after it, and the rank takes its readers' batches in a fixed cyclic order (:class:`StreamReaders`),
whatever order the worker processes deliver them in. So a checkpoint holds, per rank, each reader's state and
whose turn is next: a resume opens every reader at its state (no replay) and continues the same sequence.

Any other ``IterableDataset`` is read whole by every rank and worker, each keeping its rows of each global
batch (:class:`RankShard`), and a resume replays it from the start of the epoch.
"""

from __future__ import annotations

import copy
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset, default_collate, get_worker_info

__all__ = ["RankShard", "StreamReaders", "can_shard", "open_reader", "reader_collate"]

Batch = dict[str, torch.Tensor]


def _is_hf_iterable(ds: Any) -> bool:
    return type(ds).__module__.startswith("datasets.") and hasattr(ds, "state_dict")


def can_shard(ds: Any) -> bool:
    """True for a stream that each reader can read in part and resume from its state (see the module doc)."""
    stateful = callable(getattr(ds, "state_dict", None)) and callable(getattr(ds, "load_state_dict", None))
    return (
        isinstance(ds, IterableDataset) and stateful and (_is_hf_iterable(ds) or callable(getattr(ds, "shard", None)))
    )


class _HFReader:
    """One reader's part of a Hugging Face ``IterableDataset``, read with ``.iter()``, not ``__iter__``: inside a
    DataLoader worker ``__iter__`` splits the shards over the workers once more, and the split over ranks x
    workers is already done."""

    def __init__(self, part: Any) -> None:
        self.part = part

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for rows in self.part.iter(batch_size=1):
            yield {k: v[0] for k, v in rows.items()}

    def state_dict(self) -> dict[str, Any]:
        return self.part.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.part.load_state_dict(sd)


def reader_collate(item: Any) -> Any:
    """The DataLoader's ``collate_fn`` for the readers' ready-made batches: ``batch_size=None`` otherwise runs
    ``default_convert`` over every item, the reader's state included (measured: a third of the read time)."""
    return item


def open_reader(ds: Any, rank: int, world_size: int, worker: int, num_workers: int) -> Any:
    """Reader ``(rank, worker)``'s part of the shardable stream ``ds``: an iterable with ``state_dict`` and
    ``load_state_dict``."""
    if _is_hf_iterable(ds):
        from datasets.distributed import split_dataset_by_node  # the data set is one: datasets is installed

        return _HFReader(
            split_dataset_by_node(ds, rank=rank * num_workers + worker, world_size=world_size * num_workers)
        )
    return ds.shard(rank, world_size, worker, num_workers)


class _ReaderStream(IterableDataset):
    """What one rank's DataLoader iterates: in each worker, that worker's reader, as ``(reader, batch, state)``
    triples of ``per_rank`` items; ``(reader, None, None)`` when the reader has no full batch left."""

    def __init__(
        self,
        source: Any,
        per_rank: int,
        rank: int,
        world_size: int,
        states: list[Any],
        ended: list[bool],
        skips: list[int],
    ) -> None:
        self.source, self.per_rank, self.rank, self.world_size = source, per_rank, rank, world_size
        self.states, self.ended, self.skips = states, ended, skips

    def __iter__(self) -> Iterator[tuple[int, Batch | None, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if self.ended[worker]:
            yield worker, None, None
            return
        reader = open_reader(self.source, self.rank, self.world_size, worker, workers)
        if self.states[worker] is not None:
            reader.load_state_dict(self.states[worker])
        items = iter(reader)
        # Only after a resume on another layout (trainer.allow_reshuffle): this reader's share of the batches
        # the run had consumed, read and dropped.
        for _ in range(self.skips[worker] * self.per_rank):
            next(items, None)
        while True:
            batch = list(itertools.islice(items, self.per_rank))
            if len(batch) < self.per_rank:
                yield worker, None, None
                return
            # A copy: the queue to the main process pickles later, and a reader may update its state in place.
            yield worker, default_collate(batch), copy.deepcopy(reader.state_dict())


class StreamReaders:
    """One rank's readers of a shardable stream in one epoch: whose turn it is, each one's state, which ended.

    The readers take turns in cyclic order (``0, 1, ..., n-1, 0, ...``, skipping those that ended). Batches
    that arrive before their turn wait (at most about one per reader): the order is this rule's, not the
    order in which worker processes happen to deliver.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.reset()

    def reset(self) -> None:
        """A new epoch: every reader at its start."""
        self.next, self.states, self.ended, self.skips = 0, [None] * self.n, [False] * self.n, [0] * self.n
        self._waiting: dict[int, deque[tuple[Batch | None, Any]]] = {j: deque() for j in range(self.n)}

    def dataset(self, source: Any, per_rank: int, rank: int, world_size: int) -> _ReaderStream:
        """The ``IterableDataset`` for this rank's DataLoader, opening each reader where it stands."""
        self._waiting = {j: deque() for j in range(self.n)}
        return _ReaderStream(source, per_rank, rank, world_size, list(self.states), list(self.ended), list(self.skips))

    def take(self, it: Iterator[tuple[int, Batch | None, Any]]) -> Batch | None:
        """The next batch in turn from the DataLoader iterator ``it``; ``None`` when every reader has ended."""
        while not all(self.ended):
            j = next(k % self.n for k in range(self.next, self.next + self.n) if not self.ended[k % self.n])
            while not self._waiting[j]:
                reader, batch, state = next(it, (j, None, None))  # an exhausted iterator ends the reader
                self._waiting[reader].append((batch, state))
            batch, state = self._waiting[j].popleft()
            if batch is None:
                self.ended[j] = True
                continue
            self.states[j], self.next = state, (j + 1) % self.n
            return batch
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"workers": self.n, "next": self.next, "states": self.states, "ended": self.ended}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.reset()
        self.next, self.states, self.ended = int(sd["next"]), list(sd["states"]), list(sd["ended"])

    def skip_consumed(self, batches: int) -> None:
        """Continue a run saved with another layout at its global position: fresh readers, each dropping its
        turn's share of the ``batches`` this rank had taken (a replay; samples may repeat or be skipped)."""
        self.reset()
        self.skips = [(batches - j + self.n - 1) // self.n for j in range(self.n)]
        self.next = batches % self.n


class RankShard(IterableDataset):
    """An iterable stream's items for this rank and DataLoader worker: complete global batches only.

    Every rank and worker reads the whole stream (it cannot seek); of global batch ``k`` (items
    ``[k*B, (k+1)*B)``) rank ``r`` keeps its slice, and worker ``k % num_workers`` yields it, which is the
    order in which the DataLoader takes batches from its workers.
    """

    def __init__(self, source: IterableDataset, batch_size: int, rank: int, world_size: int, skip: int) -> None:
        self.source, self.batch_size, self.rank, self.world_size, self.skip = source, batch_size, rank, world_size, skip

    def __iter__(self) -> Iterator[Batch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        b = self.batch_size // self.world_size
        stream = iter(self.source)
        for _ in range(self.skip * self.batch_size):  # the batches a resumed run has consumed already
            next(stream, None)
        for k in itertools.count():
            items = list(itertools.islice(stream, self.batch_size))
            if len(items) < self.batch_size:
                return
            if k % workers == worker:
                yield from items[self.rank * b : (self.rank + 1) * b]
