"""``data=hf``: local text data read through Hugging Face ``datasets``, tokenized, packed into ``model.seq_len``
windows; a token cache read like ``data=tokens`` (map-style), or a stream each reader reads in part.

``datasets`` and ``transformers`` are the ``hf`` extra, imported here only when ``data=hf`` asks for them.
Nothing is downloaded: a ``datasets`` directory (``save_to_disk``) or local ``.jsonl``/``.json``/``.parquet``/
``.txt`` files (a path or a glob).
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import random
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch.utils.data import IterableDataset

from distckpt.errors import ConfigError
from distckpt.train.data import TokenWindows

# File suffix -> the packaged `datasets` builder that reads it (no loading script, no Hub).
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
_TOKENIZE_ROWS = 1000  # documents tokenized per call while writing the token cache
# How much `datasets` reads of a file at a time (json/text: bytes, parquet: rows). Its default, 10 MiB, was most
# of a stream's memory: 300k documents, peak RSS 474 MiB with it, 376 MiB with 1 MiB (datasets 5.2, alone).
READ_CHUNK = {"json": {"chunksize": 1 << 20}, "text": {"chunksize": 1 << 20}, "parquet": {"batch_size": 1024}}
_STREAM_ROWS = 128  # documents a stream reader reads and tokenizes at a time (one tokenizer call)


def text_files(path: str) -> list[str]:
    """The local files of ``data.path`` (a file or a glob), sorted; ``[]`` for a ``datasets`` directory."""
    if Path(path).is_dir():
        return []
    return sorted(glob.glob(path)) if glob.has_magic(path) else [path]


def check_source(path: str) -> None:
    """Raise unless ``data.path`` is a ``datasets`` directory or names local files of one known format.

    Raises:
        ConfigError: nothing there, an unknown suffix, or formats mixed.
    """
    if Path(path).is_dir():
        if not any((Path(path) / f).is_file() for f in ("dataset_info.json", "dataset_dict.json", "state.json")):
            raise ConfigError(
                f"data.path={path} is a directory but not one written by datasets' save_to_disk; give such a "
                "directory or local .jsonl/.parquet/.txt files (a glob works)."
            )
        return
    files = text_files(path)
    if not files or not all(Path(f).is_file() for f in files):
        raise ConfigError(f"data.path={path} matches no file or directory; give a local path (nothing is downloaded).")
    suffixes = {Path(f).suffix for f in files}
    if len(suffixes) > 1 or not suffixes <= BUILDERS.keys():
        raise ConfigError(
            f"data.path={path}: files of type {', '.join(sorted(suffixes))}; data=hf reads one of "
            f"{', '.join(BUILDERS)} at a time."
        )


def load_text(path: str, *, streaming: bool, field: str | None = None, readers: int = 1) -> Any:
    """``data.path`` as a ``datasets.Dataset`` (``streaming=False``) or ``datasets.IterableDataset``.

    A stream of local ``.jsonl``/``.txt`` files with ``field`` given is read in byte ranges (:func:`line_ranges`,
    a multiple of ``readers`` of them); other streams through ``datasets``' own builders, one shard per file.

    Raises:
        ConfigError: see :func:`check_source`; a ``DatasetDict`` without a ``train`` split.
    """
    import datasets  # optional dependency (extra "hf")

    check_source(path)
    files = text_files(path)
    if streaming and field is not None and files and Path(files[0]).suffix in _LINE_FORMATS:
        # Why not datasets' json/text builders: a file is one shard there, and a resume re-reads the shard up to
        # its position (datasets 5.2: ExamplesIterable skips shard_example_idx items), so resuming deep in one big
        # file costs O(position) and a single file cannot be split over the readers. Byte ranges of at most
        # _RANGE_BYTES make a resume re-read at most one range, and give every reader its own ranges.
        ranges = line_ranges(files, readers)
        return datasets.IterableDataset.from_generator(
            _range_rows,
            gen_kwargs={"shards": ranges, "field": field, "source": path},
            features=datasets.Features({field: datasets.Value("string")}),
        )
    if Path(path).is_dir():
        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise ConfigError(f"data.path={path} has the splits {sorted(ds)} and no 'train'; save one as 'train'.")
            ds = ds["train"]
        # One shard per 1024 rows (at least one): enough parts for the ranks x workers that read it.
        return ds.to_iterable_dataset(num_shards=max(1, min(len(ds) // 1024, 256))) if streaming else ds
    builder = BUILDERS[Path(files[0]).suffix]
    return datasets.load_dataset(builder, data_files=files, split="train", streaming=streaming, **READ_CHUNK[builder])


_LINE_FORMATS = {".jsonl", ".txt"}  # one document per line: a stream of them splits at line starts
_RANGE_BYTES = 1 << 20  # the most a resumed reader re-reads: one byte range of the files
_SHARD_UNIT = 1680  # 2^4 * 3 * 5 * 7: a shard count that most reader counts divide


def line_ranges(files: list[str], readers: int) -> list[list[tuple[str, int, int]]]:
    """The files' bytes cut into ``n`` nearly equal shards, ``n`` the least multiple of ``lcm(1680, readers)`` that
    keeps each shard within ``_RANGE_BYTES``: ``split_dataset_by_node`` then gives whole shards to each of ``readers``
    readers, and of any layout of 1-8, 10, 12, 14, 15, 16, 20, 24 ... readers that a test or a resume builds. A
    shard is a list of ``(file, start, end)`` segments; a line belongs to the segment in which its first byte lies."""
    sizes = [os.path.getsize(f) for f in files]
    total, unit = sum(sizes), math.lcm(_SHARD_UNIT, max(1, readers))
    n = unit * max(1, -(-total // (unit * _RANGE_BYTES)))
    bounds = [round(i * total / n) for i in range(n + 1)]
    shards: list[list[tuple[str, int, int]]] = []
    for a, b in zip(bounds, bounds[1:]):
        segments, offset = [], 0
        for f, size in zip(files, sizes):
            lo, hi = max(a, offset), min(b, offset + size)
            if lo < hi:
                segments.append((f, lo - offset, hi - offset))
            offset += size
        shards.append(segments)
    return shards


def _lines(file: str, start: int, end: int) -> Iterator[bytes]:
    """The lines of ``file`` whose first byte lies in ``[start, end)``."""
    with open(file, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            f.readline()  # the rest of the line that began before start (nothing if byte start-1 ends a line)
        while f.tell() < end:
            line = f.readline()
            if not line:
                return
            yield line


def _range_rows(shards: list[list[tuple[str, int, int]]], field: str, source: str) -> Iterator[dict[str, str]]:
    """``datasets.IterableDataset.from_generator``'s generator: the documents of ``shards`` (datasets passes each
    shard's slice of the list), as the json and text builders read them: a JSON object per non-blank line, or
    each line of text (``str.splitlines``, as the text builder splits, blank lines included)."""
    for segments in shards:
        for file, start, end in segments:
            text = file.endswith(".txt")
            for raw in _lines(file, start, end):
                line = raw.decode("utf-8")
                if text:
                    yield from ({field: part} for part in (line.splitlines() or [""]))
                    continue
                if not line.strip():
                    continue
                row = json.loads(line)
                if not isinstance(row, dict) or field not in row:
                    keys = sorted(row) if isinstance(row, dict) else type(row).__name__
                    raise ConfigError(
                        f"data.path={source} has the columns {keys}, no {field!r}; set data.text_field=... "
                        f"(a line of {file} after byte {start})"
                    )
                yield {field: row[field]}


def _encoder(tokenizer: Any, eos: int | None) -> Any:
    """``texts -> token ids of each``, with the tokenizer's own special tokens (Llama's bos) and ``eos``
    after each document, so that packed documents stay apart."""

    def encode(texts: list[str]) -> list[list[int]]:
        ids = tokenizer(texts, add_special_tokens=True)["input_ids"]
        return [x + [eos] if eos is not None and (not x or x[-1] != eos) else x for x in ids]

    return encode


def _field(rows: dict[str, Any], field: str, path: str) -> list[str]:
    if field not in rows:
        raise ConfigError(f"data.path={path} has the columns {sorted(rows)}, no {field!r}; set data.text_field=...")
    return rows[field]


class PackedText(IterableDataset):
    """A ``datasets.IterableDataset`` of documents as a stream of ``seq_len``-token windows, read in part.

    The shard hook (:mod:`distckpt.train.streams`) gives each reader its part of the documents
    (``split_dataset_by_node`` over ranks x workers: whole shards when their number divides the readers, else
    every reader reads all and keeps one document in that many). A reader tokenizes its documents, packs them
    into windows and, with ``shuffle_block > 1``, shuffles them in blocks of that many windows with a seeded
    permutation per block. Its state is where its current block began (the ``datasets`` state and the tokens
    carried over) and how many windows of the block it gave: a resume re-reads at most one block.
    """

    def __init__(
        self,
        docs: Any,
        *,
        tokenizer: str,
        field: str,
        seq_len: int,
        eos: int | None,
        shuffle_block: int,
        seed: int,
        source: str,
    ) -> None:
        self.docs, self.tokenizer, self.field, self.seq_len, self.eos = docs, tokenizer, field, seq_len, eos
        self.shuffle_block, self.seed, self.source, self.epoch = shuffle_block, seed, source, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.docs.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch}  # the readers hold the positions

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.set_epoch(int(sd["epoch"]))

    def shard(self, rank: int, world_size: int, worker: int, num_workers: int) -> _PackedReader:
        from datasets.distributed import split_dataset_by_node

        index, readers = rank * num_workers + worker, world_size * num_workers
        part = split_dataset_by_node(self.docs, rank=index, world_size=readers) if readers > 1 else self.docs
        return _PackedReader(self, part, index)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:  # the whole stream: one reader of one
        return iter(self.shard(0, 1, 0, 1))


class _PackedReader:
    """One reader's windows of :class:`PackedText` (see there for the state)."""

    def __init__(self, text: PackedText, part: Any, index: int) -> None:
        self.text, self.part, self.index = text, part, index
        # carry: the tokens read and not yet in a window, as int32 bytes (the state travels with every batch).
        self.position: dict[str, Any] = {"source": None, "carry": b"", "block": 0, "taken": 0}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.position)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.position = dict(sd)

    def _windows(self, docs: Iterator[dict[str, Any]], carry: list[int], encode: Any) -> tuple[list[list[int]], bool]:
        """The next block of windows (fewer at the end of the part) and whether the part has ended."""
        t = self.text
        windows: list[list[int]] = []
        while len(windows) < t.shuffle_block:
            while len(carry) < t.seq_len:
                rows = next(docs, None)
                if rows is None:
                    return windows, True
                carry.extend(i for ids in encode(_field(rows, t.field, t.source)) for i in ids)
            windows.append(carry[: t.seq_len])
            del carry[: t.seq_len]
        return windows, False

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        from launch.hf import load_tokenizer

        t, pos = self.text, self.position
        encode = _encoder(load_tokenizer(t.tokenizer), t.eos)
        if pos["source"] is not None:
            self.part.load_state_dict(pos["source"])
        # Documents a few dozen at a time (one tokenizer call each): the carry holds every token read and not
        # yet in a window, so the state at a block's start is datasets' state after a whole read plus it.
        docs = iter(self.part.iter(batch_size=_STREAM_ROWS))
        carry, block, skip = array("i", pos["carry"]).tolist(), int(pos["block"]), int(pos["taken"])
        source = pos["source"]  # the first block's start: before iterating, datasets' state is not yet live
        while True:
            start = {"source": source, "carry": array("i", carry).tobytes(), "block": block}
            windows, ended = self._windows(docs, carry, encode)
            order = list(range(len(windows)))
            if t.shuffle_block > 1:
                random.Random(f"{t.seed}/{t.epoch}/{self.index}/{block}").shuffle(order)
            for taken, k in enumerate(order[skip:], start=skip + 1):
                self.position = {**start, "taken": taken}  # before the yield: state_dict() is read after it
                yield {"tokens": torch.tensor(windows[k], dtype=torch.long)}
            if ended:
                return
            block, skip, source = block + 1, 0, self.part.state_dict()


def _cache_key(path: str, tokenizer: str, field: str, eos: int | None) -> str:
    """A name for the token cache of these sources, tokenizer and field: changes when any file changes."""
    sources = [Path(path)] if Path(path).is_dir() else [Path(f) for f in text_files(path)]
    files = [f for s in sources for f in ([s] if s.is_file() else sorted(s.rglob("*")))]
    files += sorted(Path(tokenizer).glob("*token*"))
    parts = [
        field,
        str(eos),
        *(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files if f.is_file()),
    ]
    return hashlib.sha1(json.dumps(parts).encode()).hexdigest()[:16]


def _write_token_cache(docs: Any, out: Path, encode: Any, field: str, path: str, dtype: str) -> None:
    import numpy as np

    tmp = out.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        for rows in docs.iter(batch_size=_TOKENIZE_ROWS):
            for ids in encode(_field(rows, field, path)):
                np.asarray(ids, dtype=dtype).tofile(f)
    os.replace(tmp, out)  # atomic: a reader never sees half a cache


def _local_first(fn: Any) -> Any:
    """Run ``fn`` on each node's local rank 0 first, then on the others (which find its cache): every rank
    passes one barrier, the first ones after ``fn``, the others before."""
    first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    dist_on = dist.is_available() and dist.is_initialized()
    if dist_on and not first:
        dist.barrier()
    result = fn()
    if dist_on and first:
        dist.barrier()
    return result


def _readers(d: DictConfig) -> int:
    """How many readers this run's stream has: ranks x DataLoader workers (at least one each)."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    world = world or int(os.environ.get("WORLD_SIZE", "1"))
    return world * max(1, int(d.num_workers))


def build_hf_data(d: DictConfig, m: DictConfig) -> tuple[Any, Any]:
    """The train and eval data sets of ``data=hf`` (eval ``None`` without ``data.eval_path``).

    Raises:
        ConfigError: no tokenizer, a tokenizer larger than the model's vocabulary, or a bad ``data.path``.
    """
    from launch.hf import load_tokenizer

    tok_dir = d.tokenizer or (m.get("pretrained") if m.name == "hf" else None)
    if not tok_dir:
        raise ConfigError(
            "data=hf needs a tokenizer: data.tokenizer=DIR (a directory written by save_pretrained), or "
            "model=hf model.pretrained=DIR, whose tokenizer is the default."
        )
    tok = load_tokenizer(tok_dir)
    if "vocab_size" in m and len(tok) > m.vocab_size:
        raise ConfigError(
            f"the tokenizer {tok_dir} has {len(tok)} tokens, more than model.vocab_size={m.vocab_size}; "
            f"set model.vocab_size={len(tok)} (or use the pretrained model's own tokenizer)."
        )
    eos = tok.eos_token_id
    dtype = "uint16" if len(tok) <= 2**16 else "uint32"

    def make(path: str) -> Any:
        if d.streaming:
            docs = load_text(path, streaming=True, field=d.text_field, readers=_readers(d))
            block = d.shuffle_block if d.shuffle else 1
            return PackedText(
                docs,
                tokenizer=tok_dir,
                field=d.text_field,
                seq_len=m.seq_len,
                eos=eos,
                shuffle_block=block,
                seed=d.seed,
                source=path,
            )
        cache = Path(d.cache_dir or os.environ.get("DISTCKPT_CACHE", "~/.cache/distckpt")).expanduser() / "tokens"
        out = cache / f"{_cache_key(path, tok_dir, d.text_field, eos)}.{dtype}"

        def tokenize() -> None:
            if not out.is_file():
                cache.mkdir(parents=True, exist_ok=True)
                _write_token_cache(load_text(path, streaming=True), out, _encoder(tok, eos), d.text_field, path, dtype)

        _local_first(tokenize)
        return TokenWindows(str(out), m.seq_len, dtype)

    return make(d.path), make(d.eval_path) if d.eval_path else None
