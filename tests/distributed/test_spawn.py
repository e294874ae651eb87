"""The library's spawner (doctor, benchmarks): per-rank results, errors and hangs as RankFailure."""

import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

import distckpt._spawn as spawn
from distckpt._spawn import RankFailure, free_port, run_ranks

pytestmark = pytest.mark.dist


HANG_S = 20  # run_ranks' timeout in the hang case; the start (imports) counts too


def _body(rank, world, mode, until=0.0):
    if mode == "fail":
        if rank == 1:
            raise ValueError("boom on rank 1")
        return rank
    if mode == "hang":
        if rank == 0:
            dist.all_reduce(torch.ones(1))  # rank 1 never joins
        # Alive until a second past run_ranks' deadline (``until``, set before it started the ranks), so
        # rank 0 waits instead of seeing a closed connection. Then rank 1 returns and rank 0's all_reduce
        # sees it gone: both exit, and run_ranks' joins end at once (a 120 s sleep cost 2 x 10 s of joins).
        time.sleep(max(0.0, until - time.time()))
        return rank
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item(), int(os.environ["MASTER_PORT"])


def test_results_errors_and_hangs(monkeypatch):
    # The ranks meet at a store this process serves (host_store), bound from before they start until they
    # are done: a spawner starting at the same time (another pytest-xdist worker) is never handed its port.
    held, host_store = [], spawn.host_store

    def recording_host_store():
        store = host_store()
        held.append(store.port)
        with socket.socket() as s, pytest.raises(OSError):
            s.bind(("127.0.0.1", store.port))
        return store

    monkeypatch.setattr(spawn, "host_store", recording_host_store)
    assert run_ranks(_body, 2, "sum", timeout=60) == {0: (3.0, held[0]), 1: (3.0, held[0])}
    monkeypatch.undo()
    failed = run_ranks(_body, 2, "fail", timeout=60)
    assert failed[0] == 0 and isinstance(failed[1], RankFailure)
    assert failed[1].kind == "ValueError" and "boom on rank 1" in failed[1].message
    hung = run_ranks(_body, 2, "hang", time.time() + HANG_S + 1, timeout=HANG_S)
    assert [hung[r].kind for r in (0, 1)] == ["timeout", "timeout"]
    assert f"rank 0 did not finish in {HANG_S}s" in hung[0].message


def test_free_port_is_bindable():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
