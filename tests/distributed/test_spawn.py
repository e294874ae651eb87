"""The library's spawner (doctor, benchmarks): per-rank results, errors and hangs as RankFailure."""

import time

import pytest
import torch
import torch.distributed as dist

from distckpt._spawn import RankFailure, free_port, run_ranks

pytestmark = pytest.mark.dist


def _body(rank, world, mode):
    if mode == "fail":
        if rank == 1:
            raise ValueError("boom on rank 1")
        return rank
    if mode == "hang":
        if rank == 0:
            dist.all_reduce(torch.ones(1))  # rank 1 never joins
        time.sleep(120)  # alive, so rank 0 waits instead of seeing a closed connection
        return rank
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def test_results_errors_and_hangs():
    assert run_ranks(_body, 2, "sum", timeout=60) == {0: 3.0, 1: 3.0}
    failed = run_ranks(_body, 2, "fail", timeout=60)
    assert failed[0] == 0 and isinstance(failed[1], RankFailure)
    assert failed[1].kind == "ValueError" and "boom on rank 1" in failed[1].message
    hung = run_ranks(_body, 2, "hang", timeout=20)  # the start (imports) counts too
    assert [hung[r].kind for r in (0, 1)] == ["timeout", "timeout"]
    assert "rank 0 did not finish in 20s" in hung[0].message


def test_free_port_is_bindable():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
