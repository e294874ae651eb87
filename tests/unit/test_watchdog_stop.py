"""The hang watchdog's thread ends when asked, without waiting out its look interval: the interpreter's exit stops
it (atexit) before finalization, where a daemon thread inside a c10d store call would abort the process."""

from __future__ import annotations

import time

import torch.distributed as dist

from distckpt.parallel import watchdog


def test_stop_ends_the_thread_within_its_interval():
    w = watchdog.Watchdog(dist.HashStore(), rank=0, world=1, limit=300.0, poll=120.0)
    assert w._thread.is_alive()
    start = time.monotonic()
    w.stop(timeout=10.0)
    assert not w._thread.is_alive()
    assert time.monotonic() - start < 10.0


def test_the_live_watchdogs_are_stopped_at_exit(monkeypatch):
    w = watchdog.Watchdog(dist.HashStore(), rank=0, world=1, limit=300.0, poll=120.0)
    monkeypatch.setattr(watchdog, "_WATCHDOGS", [w])
    watchdog._stop_at_exit()
    assert not w._thread.is_alive()
