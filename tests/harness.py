"""A small multi-process test harness: N gloo ranks on CPU that run test functions.

Kept here instead of ``torch.testing._internal`` (private, changes between releases). Each rank is
set up by the library's spawner (:func:`distckpt._spawn.init_rank`); the ranks are started once per
test session and reused (a spawn costs seconds of imports); a call that fails on
some rank, or does not finish in time (a hang), restarts them so the next test starts clean.

Usage::

    def body(rank, world_size, x):       # module level, so it pickles by reference
        ...
        return value                     # returned per rank

    results = pool.run(body, x)          # [value_rank0, value_rank1]
"""

from __future__ import annotations

import queue
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from distckpt._spawn import host_store, init_rank

__all__ = ["DistPool", "RankError"]


class RankError(RuntimeError):
    """An exception raised on a rank; ``.errors`` maps rank -> (exception type name, message)."""

    def __init__(self, errors: dict[int, tuple[str, str, str]]):
        self.errors = errors
        lines = [f"rank {r}: {kind}: {msg}\n{tb}" for r, (kind, msg, tb) in sorted(errors.items())]
        super().__init__("\n".join(lines))

    def kinds(self) -> set[str]:
        return {kind for kind, _, _ in self.errors.values()}

    def messages(self) -> str:
        return "\n".join(msg for _, msg, _ in self.errors.values())


def _worker(rank: int, world_size: int, port: int, path: list[str], inbox: Any, outbox: Any) -> None:
    import torch.distributed as dist

    init_rank(rank, world_size, port, path=path, threads=1)
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            outbox.put((rank, True, fn(rank, world_size, *args, **kwargs)))
        except BaseException as e:  # reported to the parent, which decides
            outbox.put((rank, False, (type(e).__name__, str(e), traceback.format_exc())))
    dist.destroy_process_group()


class DistPool:
    """``world_size`` CPU ranks joined in a gloo process group, reused across calls."""

    def __init__(self, world_size: int = 2, timeout: float = 120.0):
        self.world_size = world_size
        self.timeout = timeout
        self._procs: list[Any] = []
        self._store: Any = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._store = host_store()  # held until close(): no other process is given its port meanwhile
        port = self._store.port
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(target=_worker, args=(r, self.world_size, port, list(sys.path), self._inboxes[r], self._outbox),
                        daemon=True)
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def close(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
        self._procs = []
        self._store = None

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return the per-rank results.

        Raises:
            RankError: when any rank raised (the ranks are restarted).
            TimeoutError: when the ranks did not all answer in time, e.g. a hang in a collective.
        """
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for box in self._inboxes:
            box.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        errors: dict[int, tuple[str, str, str]] = {}
        limit = timeout or self.timeout
        try:
            while len(results) + len(errors) < self.world_size:
                rank, ok, value = self._outbox.get(timeout=limit)
                (results if ok else errors)[rank] = value
                if errors:
                    # The other ranks may be stuck in a collective the failed rank never joined:
                    # give them a short while, then restart.
                    limit = min(limit, 10.0)
        except queue.Empty:
            self.close()
            if errors:
                raise RankError(errors) from None
            missing = sorted(set(range(self.world_size)) - set(results))
            raise TimeoutError(f"ranks {missing} did not finish {fn.__name__} in {limit:.0f}s (a hang?)") from None
        if errors:
            self.close()
            raise RankError(errors)
        return [results[r] for r in range(self.world_size)]
