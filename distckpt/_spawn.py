"""Start N CPU ranks joined in a gloo process group and collect what each returns.

The one spawner of ``distckpt doctor``, the benchmarks (``benchmarks/ranks.py``) and the test harness
(``tests/harness.py``, which keeps its ranks across calls but sets each one up with :func:`init_rank`).
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

__all__ = ["RankFailure", "free_port", "host_store", "init_rank", "run_ranks"]

# After one rank failed, the others may wait in a collective it never joined: give them this long.
_AFTER_FAILURE_S = 10.0


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 now (for ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_store() -> Any:
    """A ``TCPStore`` served by this process on a port the kernel picks (its ``.port``), for ranks that it
    spawns to rendezvous at (:func:`init_rank`). The port stays bound while the store lives: a
    :func:`free_port` is free only until someone binds it, and a process that starts ranks at the same time
    (another pytest-xdist worker, a second ``distckpt doctor``) could be handed the same one meanwhile.
    """
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def init_rank(
    rank: int,
    world: int,
    port: int,
    *,
    path: list[str] | None = None,
    threads: int | None = None,
    timeout: float | None = None,
) -> None:
    """Set up a spawned process as rank ``rank`` of ``world``: torchrun's environment variables, the
    parent's ``sys.path``, ``threads`` intra-op threads (default: the cores shared out), and a gloo group
    whose rendezvous is the parent's :func:`host_store` on ``port``.

    Args:
        timeout: seconds a collective may wait before gloo raises (default: torch's).
    """
    import torch
    import torch.distributed as dist

    if path is not None:
        sys.path[:] = path
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 2) // world))
    kwargs = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, **kwargs)  # as env:// would
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, **kwargs)


@dataclass
class RankFailure:
    """What a rank returned instead of a result: an exception it raised, or a timeout (``kind="timeout"``)."""

    kind: str  # the exception's type name, or "timeout"
    message: str
    traceback: str = ""


def _entry(
    rank: int,
    world: int,
    port: int,
    path: list[str],
    threads: int | None,
    pg_timeout: float | None,
    target: Callable[..., Any],
    args: tuple[Any, ...],
    out: Any,
) -> None:
    import torch.distributed as dist

    init_rank(rank, world, port, path=path, threads=threads, timeout=pg_timeout)
    try:
        out.put((rank, target(rank, world, *args)))
    except BaseException as e:  # reported to the parent, which decides
        out.put((rank, RankFailure(type(e).__name__, str(e), traceback.format_exc())))
    finally:
        dist.destroy_process_group()


def run_ranks(
    target: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 300.0,
    threads: int | None = None,
    pg_timeout: float | None = None,
) -> dict[int, Any]:
    """Run ``target(rank, world, *args)`` on ``world`` spawned CPU ranks joined over gloo.

    ``target`` and ``args`` must pickle (a module-level function; ``functools.partial`` of one is fine).
    Ranks that do not answer within ``timeout`` seconds (a hang in a collective) are killed.

    Args:
        threads: intra-op threads per rank (default: the machine's cores shared out).
        pg_timeout: seconds a collective may wait before gloo raises (default: torch's).

    Returns:
        ``{rank: result}`` for every rank; a rank that raised or timed out maps to a :class:`RankFailure`.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store, path = host_store(), [os.getcwd(), *sys.path]
    procs = [
        ctx.Process(
            target=_entry, args=(r, world, store.port, path, threads, pg_timeout, target, args, out), daemon=True
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    limit = timeout
    try:
        while len(results) < world:
            rank, value = out.get(timeout=limit)
            results[rank] = value
            if isinstance(value, RankFailure):
                limit = min(limit, _AFTER_FAILURE_S)
    except queue.Empty:
        for r in range(world):
            results.setdefault(r, RankFailure("timeout", f"rank {r} did not finish in {limit:.0f}s (a hang?)"))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        del store  # the rendezvous' port is released here, after the ranks
    return results
