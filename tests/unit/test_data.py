"""ShardedLoader: each rank reads its slice of one global batch, per-epoch seeded shuffles, exact resume."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import IterableDataset

from distckpt.errors import ConfigError, ResumeError
from distckpt.train.data import DictDataset, ShardedLoader, micro_batches


def _ids(n: int) -> DictDataset:
    return DictDataset({"i": torch.arange(n)})


def _take(loader: ShardedLoader, steps: int) -> list[list[int]]:
    return [loader.next_batch()["i"].tolist() for _ in range(steps)]


def test_ranks_read_disjoint_slices_of_the_single_process_global_batch():
    single = _take(ShardedLoader(_ids(40), 8, seed=3, rank=0, world_size=1), 12)  # 5 batches/epoch: 2+ epochs
    ranks = [_take(ShardedLoader(_ids(40), 8, seed=3, rank=r, world_size=2), 12) for r in range(2)]
    for step in range(12):
        assert ranks[0][step] + ranks[1][step] == single[step]  # rank r: rows [r*4, (r+1)*4) of the global batch
    epoch0, epoch1 = sum(single[:5], []), sum(single[5:10], [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(40))  # each epoch sees every sample once
    assert epoch0 != epoch1  # a new permutation each epoch
    assert epoch0 == torch.randperm(40, generator=torch.Generator().manual_seed(3)).tolist()


def test_drop_last_and_padding():
    kept = _take(ShardedLoader(_ids(10), 4, shuffle=False, rank=0, world_size=1), 3)
    assert kept == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]  # 8, 9 dropped; the next epoch begins
    padded = _take(ShardedLoader(_ids(10), 4, shuffle=False, drop_last=False, rank=0, world_size=1), 3)
    assert padded == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("cut", [3, 5, 7])  # mid-epoch, at the epoch boundary, in the next epoch
def test_resume_from_state_continues_exactly(workers, cut):
    ref = _take(ShardedLoader(_ids(40), 8, seed=1, rank=1, world_size=2, num_workers=workers), 12)
    first = ShardedLoader(_ids(40), 8, seed=1, rank=1, world_size=2, num_workers=workers)
    assert _take(first, cut) == ref[:cut]
    resumed = ShardedLoader(_ids(40), 8, seed=1, rank=1, world_size=2, num_workers=workers)
    resumed.load_state_dict(first.state_dict())
    assert _take(resumed, 12 - cut) == ref[cut:]


def test_a_new_iterator_leaves_the_global_rng_alone():
    # Without a generator of its own, each DataLoader iterator draws a seed from the global RNG: a resumed
    # run (one iterator fewer) would then draw a different dropout stream than an uninterrupted one.
    torch.manual_seed(0)
    before = torch.get_rng_state()
    _take(ShardedLoader(_ids(16), 4, rank=0, world_size=1), 9)
    assert torch.equal(torch.get_rng_state(), before)


class _Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return ({"i": torch.tensor(100 * self.epoch + i)} for i in range(self.n))


@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_is_sharded_by_rank_and_worker_and_resumes(workers):
    single = _take(ShardedLoader(_Stream(20), 4, rank=0, world_size=1), 7)
    assert single[:5] == [list(range(k * 4, k * 4 + 4)) for k in range(5)] and single[5] == [100, 101, 102, 103]
    ranks = [ShardedLoader(_Stream(20), 4, rank=r, world_size=2, num_workers=workers) for r in range(2)]
    got = [_take(ld, 3) for ld in ranks]
    assert [got[0][s] + got[1][s] for s in range(3)] == single[:3]
    resumed = ShardedLoader(_Stream(20), 4, rank=1, world_size=2, num_workers=workers)
    resumed.load_state_dict(ranks[1].state_dict())
    assert _take(resumed, 4) == [s[2:] for s in single[3:7]]


def test_eval_split_is_sharded_in_order_and_padded():
    loaders = [ShardedLoader(_ids(8), 4, rank=r, world_size=2, eval_dataset=_ids(6)) for r in range(2)]
    assert [[b["i"].tolist() for b in ld.eval_batches()] for ld in loaders] == [[[0, 1], [4, 5]], [[2, 3], [0, 1]]]
    assert list(ShardedLoader(_ids(8), 4, rank=0, world_size=1).eval_batches()) == []


def test_bad_sizes_name_the_setting():
    with pytest.raises(ConfigError, match="data.batch_size=6 must be a multiple of the 4 ranks"):
        ShardedLoader(_ids(8), 6, rank=0, world_size=4)
    with pytest.raises(ConfigError, match="no complete global batch of data.batch_size=16"):
        ShardedLoader(_ids(8), 16, rank=0, world_size=1).next_batch()
    with pytest.raises(ConfigError, match="multiple of 4"):
        micro_batches({"i": torch.arange(6)}, 0, 1, 4)


def test_token_windows_memmap_a_flat_id_file(tmp_path):
    np = pytest.importorskip("numpy")
    from distckpt.train.data import TokenWindows

    ids = np.arange(70_000, 70_000 + 50, dtype="uint32")  # above uint16's range
    ids.tofile(tmp_path / "t.bin")
    ds = TokenWindows(str(tmp_path / "t.bin"), seq_len=8, dtype="uint32")
    assert len(ds) == 6  # 50 // 8; the last 2 ids are no full window
    assert ds[1]["tokens"].tolist() == list(range(70_008, 70_016)) and ds[1]["tokens"].dtype == torch.int64
    batch = ShardedLoader(ds, 4, shuffle=False, rank=1, world_size=2, num_workers=1).next_batch()
    assert batch["tokens"][:, 0].tolist() == [70_016, 70_024]  # rank 1: windows 2 and 3 (a worker read them)
    with pytest.raises(ConfigError, match="token id 70049 >= model.vocab_size=1000; set model.vocab_size=70050"):
        TokenWindows(str(tmp_path / "t.bin"), seq_len=8, dtype="uint32", vocab_size=1000)
    (tmp_path / "odd.bin").write_bytes(b"\0" * 7)
    with pytest.raises(ConfigError, match="7 bytes, not a multiple of 2 \\(uint16\\); is data.dtype right"):
        TokenWindows(str(tmp_path / "odd.bin"), seq_len=2)
    with pytest.raises(ConfigError, match="fewer than one window of model.seq_len=64"):
        TokenWindows(str(tmp_path / "t.bin"), seq_len=64, dtype="uint32")
    with pytest.raises(ConfigError, match="does not exist; write one with scripts/make_tokens.py"):
        TokenWindows(str(tmp_path / "none.bin"), seq_len=8)


def test_task_mix_shares_the_batch_by_weight_and_resumes_each_task():
    from distckpt.train.data import TaskBatches, TaskMixLoader

    def make():
        return TaskMixLoader(
            {"a": (_ids(12), None), "b": (DictDataset({"i": torch.arange(100, 106)}), None)},
            {"a": 2.0, "b": 1.0},
            6,
            seed=0,
            rank=0,
            world_size=1,
        )

    ref = make().next_batch()
    assert isinstance(ref, TaskBatches) and ref["a"]["i"].shape == (4,) and ref["b"]["i"].shape == (2,)
    full = make()
    steps = [{t: b["i"].tolist() for t, b in full.next_batch().items()} for _ in range(5)]
    cut = make()
    [cut.next_batch() for _ in range(2)]  # a: 2 of 3 batches of its epoch, b: 2 of 3
    resumed = make()
    resumed.load_state_dict(cut.state_dict())
    assert [{t: b["i"].tolist() for t, b in resumed.next_batch().items()} for _ in range(3)] == steps[2:]
    parts = micro_batches(full.next_batch(), 0, 1, 2)
    assert [p["a"]["i"].shape[0] for p in parts] == [2, 2] and [p["b"]["i"].shape[0] for p in parts] == [1, 1]
    with pytest.raises(ConfigError, match="data.tasks.a.weight=1.0 gives 1.5 of data.batch_size=3"):
        TaskMixLoader({"a": (_ids(12), None), "b": (_ids(12), None)}, {"a": 1.0, "b": 1.0}, 3)


# --- resume on another world size (issue 24) -----------------------------------------------------------
def _global(loaders: list[ShardedLoader], steps: int) -> list[list[int]]:
    """Each global batch: the ranks' rows in rank order."""
    per_rank = [_take(ld, steps) for ld in loaders]
    return [sum((rows[s] for rows in per_rank), []) for s in range(steps)]


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 4)])
def test_map_style_position_resumes_exactly_on_another_world_size(before, after):
    single = _take(ShardedLoader(_ids(40), 8, seed=2, rank=0, world_size=1), 12)
    first = [ShardedLoader(_ids(40), 8, seed=2, rank=r, world_size=before) for r in range(before)]
    assert _global(first, 7) == single[:7]  # mid-epoch 2 (5 batches per epoch)
    resumed = [ShardedLoader(_ids(40), 8, seed=2, rank=r, world_size=after) for r in range(after)]
    for ld in resumed:  # a rank the first run lacked gets rank 0's position (TrainState's _LoadView)
        ld.load_state_dict(first[min(ld.rank, before - 1)].state_dict())
    assert _global(resumed, 5) == single[7:]


def test_a_stream_without_state_refuses_another_world_size_unless_reshuffle_is_allowed():
    with pytest.warns(UserWarning, match="every rank and DataLoader worker reads all of it"):
        first = ShardedLoader(_Stream(20), 4, rank=0, world_size=2)
    _take(first, 2)
    other = ShardedLoader(_Stream(20), 4, rank=0, world_size=4)
    with pytest.raises(ResumeError) as e:
        other.load_state_dict(first.state_dict())
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and "saved on 2 ranks x 1 workers on 4 ranks x 1 workers" in msg
    assert "trainer.allow_reshuffle=true" in msg
    allowed = ShardedLoader(_Stream(20), 4, rank=3, world_size=4, allow_reshuffle=True)
    allowed.load_state_dict(first.state_dict())
    assert _take(allowed, 1) == [[11]]  # global batch 2 continues (items 8..11; rank 3 of 4 has one)


class _Parts(IterableDataset):
    """A stream of ``n`` ids with the shard hook: reader ``k`` of ``K`` (``k = rank * workers + worker``) reads
    ids ``k, k + K, ...``. Every id a reader reads is appended to ``log/reads.<k>`` (counted across worker
    processes)."""

    def __init__(self, n: int, log) -> None:
        self.n, self.log, self.epoch = n, log, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):  # the whole stream: one reader of one
        return iter(self.shard(0, 1, 0, 1))

    def state_dict(self):
        return {}

    def load_state_dict(self, sd) -> None:
        pass

    def shard(self, rank: int, world_size: int, worker: int, num_workers: int) -> _Part:
        return _Part(self, rank * num_workers + worker, world_size * num_workers)


class _Part:
    def __init__(self, stream: _Parts, index: int, readers: int) -> None:
        self.stream, self.index, self.readers, self.pos = stream, index, readers, 0

    def __iter__(self):
        ids = range(self.index, self.stream.n, self.readers)
        with open(self.stream.log / f"reads.{self.index}", "a") as log:
            for i in ids[self.pos :]:  # from the saved position on: nothing before it is read again
                log.write(f"{100 * self.stream.epoch + i}\n")
                log.flush()
                self.pos += 1
                yield {"i": torch.tensor(100 * self.stream.epoch + i)}

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, sd) -> None:
        self.pos = sd["pos"]


def _reads(log) -> dict[int, list[int]]:
    return {int(p.suffix[1:]): [int(x) for x in p.read_text().split()] for p in log.glob("reads.*")}


def test_a_shardable_stream_is_read_in_part_by_each_rank_and_worker(tmp_path):
    n = 96  # 2 ranks x 2 workers: 24 ids per reader, 6 batches of 4 per reader, 12 steps per epoch
    loaders = [ShardedLoader(_Parts(n, tmp_path), 8, rank=r, world_size=2, num_workers=2) for r in range(2)]
    epoch = _global(loaders, 12)
    assert sorted(sum(epoch, [])) == list(range(n))  # every sample once: none repeated, none skipped
    reads = _reads(tmp_path)
    assert sorted(reads) == [0, 1, 2, 3] and all(len(r) == n // 4 for r in reads.values())  # N/4 per reader
    assert _global(loaders, 1)[0][0] >= 100  # then epoch 1 (set_epoch)
    assert epoch[0] == [0, 4, 8, 12, 2, 6, 10, 14]  # rank 0: reader 0 (worker 0), rank 1: reader 2


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shardable_stream_resumes_from_its_readers_states_without_rereading(tmp_path, workers):
    (tmp_path / "ref").mkdir()
    (tmp_path / "run").mkdir()
    ref = _take(ShardedLoader(_Parts(96, tmp_path / "ref"), 8, rank=1, world_size=2, num_workers=workers), 16)
    first = ShardedLoader(_Parts(96, tmp_path / "run"), 8, rank=1, world_size=2, num_workers=workers)
    assert _take(first, 5) == ref[:5]
    saved = first.state_dict()
    for p in (tmp_path / "run").glob("reads.*"):
        p.unlink()  # count what the resumed run reads
    resumed = ShardedLoader(_Parts(96, tmp_path / "run"), 8, rank=1, world_size=2, num_workers=workers)
    resumed.load_state_dict(saved)
    assert _take(resumed, 11) == ref[5:]  # the rest of epoch 0 (12 steps) and 4 steps of epoch 1
    reread = [i for r in _reads(tmp_path / "run").values() for i in r if i < 100]
    # Each reader opened at its saved state: epoch 0's samples consumed before the save are not read again.
    assert sorted(reread) == sorted({i for batch in ref[5:12] for i in batch})


def test_a_shardable_stream_refuses_another_layout_unless_reshuffle_is_allowed(tmp_path):
    first = ShardedLoader(_Parts(96, tmp_path), 8, rank=0, world_size=2, num_workers=2)
    _take(first, 3)
    with pytest.raises(ResumeError, match="saved on 2 ranks x 2 workers on 2 ranks x 1 workers in the same order"):
        ShardedLoader(_Parts(96, tmp_path), 8, rank=0, world_size=2).load_state_dict(first.state_dict())
    allowed = ShardedLoader(_Parts(96, tmp_path), 8, rank=0, world_size=4, allow_reshuffle=True)
    with pytest.warns(UserWarning, match="samples may repeat or be skipped"):
        allowed.load_state_dict(first.state_dict())
    assert len(_take(allowed, 2)) == 2


def test_a_hugging_face_iterable_is_split_over_ranks_and_workers_and_resumes(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"i": list(range(64))}).to_iterable_dataset(num_shards=4).with_format("torch")
    loaders = [ShardedLoader(ds, 8, rank=r, world_size=2, num_workers=2) for r in range(2)]
    assert all(ld.kind == "shards" for ld in loaders)
    epoch = _global(loaders, 8)
    assert sorted(sum(epoch, [])) == list(range(64))
    ref = _take(ShardedLoader(ds, 8, rank=1, world_size=2, num_workers=2), 8)
    first = ShardedLoader(ds, 8, rank=1, world_size=2, num_workers=2)
    _take(first, 3)
    resumed = ShardedLoader(ds, 8, rank=1, world_size=2, num_workers=2)
    resumed.load_state_dict(first.state_dict())
    assert _take(resumed, 5) == ref[3:]
