"""The library's spawner (doctor, benchmarks): per-rank results, errors and hangs as RankFailure."""

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

import distckpt._spawn as spawn
from distckpt._spawn import RankFailure, free_port, run_ranks

pytestmark = pytest.mark.dist


HANG_S = 20  # run_ranks' timeout in the hang case; the start (imports) counts too


def _body(rank, world, mode, until=0.0):
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
    if rank == 1:
        raise ValueError(f"boom on rank 1 after a sum of {t.item()}")
    return t.item(), int(os.environ["MASTER_PORT"])


def test_results_errors_and_hangs(monkeypatch):
    """Two spawns, at once from two threads (each rank's imports cost seconds: 3 spawns in a row took 47 s
    under load): one where rank 0 returns the sum of a collective and rank 1 raises after it (a result and a
    failure from one spawn: the sum that rank 1 saw is in its message), and the hang, whose wait of HANG_S
    the other spawn fits in. Two callers spawning at the same time is also what two pytest-xdist workers or
    two doctors do: each has its own store."""
    # The ranks meet at a store this process serves (host_store), bound from before they start until they
    # are done: a spawner starting at the same time (here: the other one) is never handed its port.
    held, host_store, lock = [], spawn.host_store, threading.Lock()

    def recording_host_store():
        store = host_store()
        with lock:
            held.append(store.port)
        with socket.socket() as s, pytest.raises(OSError):
            s.bind(("127.0.0.1", store.port))
        return store

    monkeypatch.setattr(spawn, "host_store", recording_host_store)
    with ThreadPoolExecutor(2) as pool:
        hanging = pool.submit(run_ranks, _body, 2, "hang", time.time() + HANG_S + 1, timeout=HANG_S)
        failing = pool.submit(run_ranks, _body, 2, "fail", timeout=60)
        failed, hung = failing.result(), hanging.result()
    assert len(set(held)) == 2  # two stores on two ports, bound at the same time
    assert failed[0] == (3.0, failed[0][1]) and failed[0][1] in held
    assert isinstance(failed[1], RankFailure) and failed[1].kind == "ValueError"
    assert "boom on rank 1 after a sum of 3.0" in failed[1].message
    assert [hung[r].kind for r in (0, 1)] == ["timeout", "timeout"]
    assert f"rank 0 did not finish in {HANG_S}s" in hung[0].message


def test_free_port_is_bindable():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
