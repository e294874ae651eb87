"""The harness itself: results per rank, errors reported with their rank, hangs turned into timeouts; a
rank that raised keeps its process (a fresh process group), a hang restarts the ranks."""

import os

import pytest
import torch
import torch.distributed as dist
from harness import RankError


def _allreduce(rank, world_size, x):
    t = torch.tensor([float(rank + x)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def _hang_on_one(rank, world_size):
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    return rank


def _fail_while_peer_waits(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.all_reduce(torch.ones(1))  # rank 1 never joins: its group closes under rank 0
    return rank


def _pid(rank, world_size):
    return os.getpid()


_HELD: list = []  # on the ranks: what still references their process group after a job


def _hold_the_group(rank, world_size):
    _HELD.append(dist.group.WORLD)


def _fsdp2_step(rank, world_size):
    # torch keeps the group of an FSDP2 model referenced after the job (from C++: measured, torch 2.13), so
    # destroying the group no longer closes its connections.
    from torch.distributed.fsdp import fully_shard

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    fully_shard(model[0])
    fully_shard(model)
    model(torch.ones(2, 4)).sum().backward()


def _release(rank, world_size):
    _HELD.clear()


def test_results_per_rank(dist_pool):
    assert dist_pool.run(_allreduce, 1.0) == [3.0, 3.0]


def test_error_names_rank(dist_pool):
    with pytest.raises(RankError) as e:
        dist_pool.run(_fail_on_one)
    assert set(e.value.errors) == {1} and "boom on rank 1" in e.value.messages()
    assert dist_pool.run(_allreduce, 0.0) == [1.0, 1.0]  # a fresh group, cleanly


def test_error_keeps_the_ranks(dist_pool):
    """A rank that raised serves the next call (a restart cost 10-40 s of imports under load), in a fresh
    group; a peer waiting for it in a collective raises at once instead of hanging until a restart."""
    pids, starts = dist_pool.run(_pid), dist_pool.starts
    with pytest.raises(RankError) as e:
        dist_pool.run(_fail_while_peer_waits, timeout=60)
    assert e.value.errors[1][:2] == ("ValueError", "boom on rank 1")
    assert 0 in e.value.errors, e.value  # rank 0's all_reduce failed: it did not wait out the 10 s
    assert dist_pool.run(_allreduce, 2.0) == [5.0, 5.0]
    assert dist_pool.run(_pid) == pids and dist_pool.starts == starts


@pytest.mark.parametrize("holder", [_hold_the_group, _fsdp2_step], ids=["held", "fsdp2"])
def test_a_peer_is_released_while_something_holds_the_group(dist_pool, holder):
    """test_error_keeps_the_ranks after an earlier job left the group referenced (an FSDP2 model: torch holds it).
    Destroying a gloo group closes its connections only with its last reference: the peer waited out the 10 s,
    the ranks restarted, and rank 0's error was missing (make test's flake when FSDP2 had run on the same
    worker before). The rank that raised now shuts its connections down (harness._hang_up)."""
    pids, starts = dist_pool.run(_pid), dist_pool.starts
    dist_pool.run(holder)
    try:
        with pytest.raises(RankError) as e:
            dist_pool.run(_fail_while_peer_waits, timeout=60)
    finally:
        dist_pool.run(_release)
    assert e.value.errors[1][:2] == ("ValueError", "boom on rank 1")
    assert 0 in e.value.errors, e.value  # rank 0's all_reduce failed at once
    assert dist_pool.run(_pid) == pids and dist_pool.starts == starts


def test_a_job_the_ranks_cannot_import_is_an_error_not_a_timeout(dist_pool, tmp_path, monkeypatch):
    """A job pickles by reference: a function whose module the ranks cannot import fails to unpickle in
    them. It is reported as the job's error, and the ranks stay (before: they died, and the call waited out
    its timeout)."""
    (tmp_path / "only_in_parent.py").write_text("def job(rank, world_size):\n    return rank\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import only_in_parent

    pids, starts = dist_pool.run(_pid), dist_pool.starts
    with pytest.raises(RankError) as e:
        dist_pool.run(only_in_parent.job, timeout=60)
    assert {err[0] for err in e.value.errors.values()} == {"ModuleNotFoundError"}, e.value
    assert dist_pool.run(_pid) == pids and dist_pool.starts == starts


def test_hang_becomes_timeout(dist_pool):
    pids = dist_pool.run(_pid)
    with pytest.raises(TimeoutError):
        dist_pool.run(_hang_on_one, timeout=5)
    assert dist_pool.run(_allreduce, 0.0) == [1.0, 1.0]
    assert set(dist_pool.run(_pid)).isdisjoint(pids)  # a rank stuck in a collective is restarted
