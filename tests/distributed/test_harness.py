"""The harness itself: results per rank, errors reported with their rank, hangs turned into timeouts."""

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


def test_results_per_rank(dist_pool):
    assert dist_pool.run(_allreduce, 1.0) == [3.0, 3.0]


def test_error_names_rank(dist_pool):
    with pytest.raises(RankError) as e:
        dist_pool.run(_fail_on_one)
    assert set(e.value.errors) == {1} and "boom on rank 1" in e.value.messages()
    assert dist_pool.run(_allreduce, 0.0) == [1.0, 1.0]  # restarted cleanly


def test_hang_becomes_timeout(dist_pool):
    with pytest.raises(TimeoutError):
        dist_pool.run(_hang_on_one, timeout=5)
    assert dist_pool.run(_allreduce, 0.0) == [1.0, 1.0]
