"""A small multi-process test harness: N gloo ranks on CPU that run test functions.

Kept here instead of ``torch.testing._internal`` (private, changes between releases). Each rank is
set up by the library's spawner (:func:`distckpt._spawn.init_rank`); the ranks are started once per
test session and reused (a spawn costs seconds of imports, 10-40 s on a loaded 2-core machine).

A call that raises on some rank keeps the processes: the rank that raised shuts its connections down at
once (:func:`_hang_up`, so a peer waiting for it in a collective gets an error instead of hanging), then
every rank joins a fresh group (:func:`_regroup`) before the next call, so no collective of the failed
call is left in flight. A call that does not finish in time (a hang: a rank stuck in a collective, which no message
can reach), or ranks that do not all regroup in time, restart the processes instead.

Usage::

    def body(rank, world_size, x):       # module level, so it pickles by reference
        ...
        return value                     # returned per rank

    results = pool.run(body, x)          # [value_rank0, value_rank1]
"""

from __future__ import annotations

import os
import queue
import socket
import stat
import sys
import traceback
import warnings
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


_REGROUP = "regroup"  # the job that replaces a rank's process group after a call that raised


def _regroup(rank: int, world_size: int, port: int, generation: int) -> None:
    """Leave the current process group (every group: subgroups, meshes) and join a fresh default one.

    The new group's rendezvous keys are prefixed by ``generation``: the store still holds the keys of the
    groups before it (torch names every default group "0"), which a new group must not read."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"regroup{generation}/", store), rank=rank, world_size=world_size
    )


def _hang_up() -> None:
    """Shut down every TCP connection of this rank: its process groups' (gloo's pairs), their stores'.

    Destroying a gloo group closes its connections only when the last reference to it goes, and torch keeps
    one of its own after an FSDP2 step, for the rest of the process (measured, torch 2.13: held from C++, no
    Python object refers to it, ``gc.collect()`` does not free it; ``ProcessGroup.abort()`` and the backend's
    ``shutdown()``/``abort()`` leave gloo's sockets open). The peer then waited out the call's 10 s
    after the failure and the pool restarted (test_harness's ``test_error_keeps_the_ranks`` failed when an
    earlier test on the same pytest-xdist worker had run FSDP2 on the ranks). A shut-down socket fails the
    peer's pending send or receive at once ("Connection closed by peer"), whoever still holds the group. The
    rank joins a fresh group (a new store client) before its next job. Only Linux lists a process's sockets
    (``/proc/self/fd``); elsewhere the group is left to its destructor, as before."""
    fd_dir = "/proc/self/fd"
    if not os.path.isdir(fd_dir):
        return
    for name in os.listdir(fd_dir):
        try:
            fd = int(name)
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
        except (ValueError, OSError):  # the listing's own descriptor, closed by now
            continue
        sock = socket.socket(fileno=fd)
        try:
            # Not a listening socket: gloo's listener thread aborts the process when its accept() fails.
            if (
                sock.family in (socket.AF_INET, socket.AF_INET6)
                and sock.type == socket.SOCK_STREAM
                and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            ):
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # one the peer closed already
            pass
        finally:
            sock.detach()  # the descriptor stays its owner's (gloo, the store), to close in its own time


def _error_filters() -> list[tuple[str, str, type, str, int]]:
    """The "error" warning filters in force here (pyproject.toml's filterwarnings, which pytest installs around each
    test and fixture), as ``warnings.filterwarnings`` arguments: the ranks apply them too, so a FutureWarning or
    DeprecationWarning from our own code fails a distributed test as it fails a local one."""
    return [
        (action, msg.pattern if msg is not None else "", cat, mod.pattern if mod is not None else "", lineno)
        for action, msg, cat, mod, lineno in warnings.filters
        if action == "error"
    ]


def _worker(
    rank: int, world_size: int, port: int, path: list[str], inbox: Any, outbox: Any, errors: list | None = None
) -> None:
    import torch.distributed as dist

    for action, message, category, module, lineno in reversed(errors or []):
        warnings.filterwarnings(action, message, category, module, lineno)
    import torch.distributed.nn  # noqa: F401 - before the group exists: see below

    # torch.distributed.nn.functional's collectives take ``group=group.WORLD`` as a default argument, bound when
    # the module is imported: imported by a job (DCP imports it), they would hold the rank's first group for good,
    # so that destroying it no longer closes its connections, and a peer waiting in a collective with a rank that
    # raised would hang instead of raising (measured: test_harness's test_error_keeps_the_ranks after a job that
    # imported torch.distributed.checkpoint). Imported here, they bind None.
    init_rank(rank, world_size, port, path=path, threads=1)
    while True:
        try:
            job = inbox.get()
        except Exception as e:  # noqa: BLE001 - the job did not unpickle here (its module fails to import)
            # Reported like an error of the job: a rank that died here would leave the parent waiting a timeout.
            # A peer that got the job may wait for this rank in a collective: hang up, as after an error.
            outbox.put((rank, False, (type(e).__name__, str(e), traceback.format_exc())))
            _hang_up()
            continue
        if job is None:
            break
        fn, args, kwargs = job
        try:
            if isinstance(fn, str) and fn == _REGROUP:
                _regroup(rank, world_size, port, *args)
                outbox.put((rank, True, _REGROUP))
                continue
            outbox.put((rank, True, fn(rank, world_size, *args, **kwargs)))
        except BaseException as e:  # reported to the parent, which decides
            outbox.put((rank, False, (type(e).__name__, str(e), traceback.format_exc())))
            # A peer may wait for this rank in a collective: closing the group's connections makes it
            # raise (gloo: "Connection closed by peer") and answer, instead of hanging until a restart.
            # Destroyed first: a group nothing else holds finishes its async work in its destructor, then
            # closes (hung up with async work in flight, the ranks sometimes missed the regroup); one still
            # held is hung up on.
            if dist.is_initialized():
                dist.destroy_process_group()
            _hang_up()
    if dist.is_initialized():
        dist.destroy_process_group()


class DistPool:
    """``world_size`` CPU ranks joined in a gloo process group, reused across calls."""

    # After a call that raised: how long the ranks may take to join a fresh group before they are restarted
    # (as long as a restart used to wait for a rank stuck after a failure: a rank that could not close its
    # group, async work in flight, costs no more than before).
    REGROUP_S = 10.0

    def __init__(self, world_size: int = 2, timeout: float = 120.0):
        self.world_size = world_size
        self.timeout = timeout
        self._procs: list[Any] = []
        self._store: Any = None
        self._generation = 0
        self.starts = 0  # how many times the ranks were (re)started: tests/distributed/test_harness.py

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._store = host_store()  # held until close(): no other process is given its port meanwhile
        port = self._store.port
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, port, list(sys.path), self._inboxes[r], self._outbox, _error_filters()),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()
        self.starts += 1

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
            RankError: when any rank raised (the ranks stay and join a fresh process group; a peer stuck
                in a collective with the rank that raised reports the error it got, e.g. "Connection closed").
            TimeoutError: when the ranks did not all answer in time, e.g. a hang in a collective.
        """
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        results, errors, missing = self._call(fn, args, kwargs, timeout or self.timeout)
        if missing:
            self.close()
            if errors:
                raise RankError(errors) from None
            raise TimeoutError(
                f"ranks {missing} did not finish {fn.__name__} in {timeout or self.timeout:.0f}s (a hang?)"
            ) from None
        if errors:
            self._generation += 1
            _, failed, missing = self._call(_REGROUP, (self._generation,), {}, self.REGROUP_S)
            if failed or missing:
                self.close()
            raise RankError(errors)
        return [results[r] for r in range(self.world_size)]

    def _call(
        self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], limit: float
    ) -> tuple[dict[int, Any], dict[int, tuple[str, str, str]], list[int]]:
        """Send one job to every rank; (results, errors, ranks that did not answer in time) by rank."""
        for box in self._inboxes:
            box.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        errors: dict[int, tuple[str, str, str]] = {}
        try:
            while len(results) + len(errors) < self.world_size:
                rank, ok, value = self._outbox.get(timeout=limit)
                (results if ok else errors)[rank] = value
                if errors:
                    # The other ranks may be stuck in a collective the failed rank never joined (a group it
                    # could not close: async work in flight): give them a short while, then restart.
                    limit = min(limit, 10.0)
        except queue.Empty:
            pass
        return results, errors, sorted(set(range(self.world_size)) - set(results) - set(errors))
