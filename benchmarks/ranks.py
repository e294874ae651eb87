"""Start N CPU ranks for a benchmark and collect what each returns (shared by the benchmarks).

A thin layer over the library's spawner (:mod:`distckpt._spawn`): a benchmark that fails on a rank
raises here instead of returning a half result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from distckpt._spawn import RankFailure
from distckpt._spawn import run_ranks as _spawn_ranks


def run_ranks(target: Callable[..., Any], world: int, *args: Any, timeout: float = 3600) -> dict[int, Any]:
    """Run ``target(rank, world, *args)`` on ``world`` spawned gloo CPU ranks (the process group is up,
    with the machine's cores shared out); return ``{rank: what it returned}``.

    Raises:
        RuntimeError: a rank raised or did not finish within ``timeout`` seconds.
    """
    results = _spawn_ranks(target, world, *args, timeout=timeout)
    failed = {r: v for r, v in results.items() if isinstance(v, RankFailure)}
    if failed:
        raise RuntimeError(
            "\n".join(f"rank {r}: {v.kind}: {v.message}\n{v.traceback}" for r, v in sorted(failed.items()))
        )
    return results
