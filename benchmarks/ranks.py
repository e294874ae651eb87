"""Start N CPU ranks for a benchmark and collect what each returns (shared by the benchmarks)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def run_ranks(target: Callable[..., None], world: int, *args: Any, timeout: float = 3600) -> dict[int, Any]:
    """Run ``target(rank, world, port, *args, out)`` in ``world`` spawned processes.

    Each rank puts ``(rank, result)`` on ``out``; returns ``{rank: result}``.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=target, args=(r, world, port, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join()
    return results
