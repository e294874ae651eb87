"""The per-op choice inside one block (the ``"ops"`` mode, :class:`~distckpt.runtime.selective.KeepOps`): which
outputs of the FLOP-counting op calls its recompute runs to keep, as the Pareto front of (bytes kept, recompute
FLOPs saved) over every subset, from the profile's :attr:`~distckpt.select.profile.BlockProfile.recompute_ops`.

Keeping a call's output saves exactly its FLOPs and holds exactly its output's bytes: a checkpointed block's
recompute re-runs every op whose output it did not keep (torch's selective checkpoint), and the profile lists
only the calls that recompute really runs (none after its early stop), so both sums are exact. Ops that count
no FLOPs are never kept (keeping one would hold bytes and save nothing).
"""

from __future__ import annotations

import functools

__all__ = ["MAX_SETS", "keep_sets"]

# Above this many points on a block's front (blocks with many matmuls: mixtures of experts), the points
# closer than its total bytes / MAX_SETS are merged, the one saving the most FLOPs kept: a coarser choice,
# never a wrong one (each point's bytes and FLOPs stay exact).
MAX_SETS = 64

# (op, call index, output bytes, FLOPs), as BlockProfile.recompute_ops holds them.
OpCost = tuple[str, int, int, int]
# (the kept calls, their bytes, the FLOPs they save)
KeepSet = tuple[tuple[tuple[str, int], ...], int, int]


@functools.lru_cache(maxsize=256)  # the repeated blocks of a model share one list of op costs
def keep_sets(ops: tuple[OpCost, ...], limit: int = MAX_SETS) -> tuple[KeepSet, ...]:
    """The non-empty subsets of ``ops`` on the Pareto front of (bytes kept, FLOPs saved): each holds more
    bytes than the one before and saves more FLOPs, sorted by bytes; at most about ``limit`` of them.

    Args:
        ops: a block's op calls with their output bytes and recompute FLOPs.
        limit: the most points kept (see :data:`MAX_SETS`).

    Returns:
        ``((calls, bytes, FLOPs saved), ...)``, ``calls`` sorted.
    """
    front: list[KeepSet] = [((), 0, 0)]
    useful = [op for op in ops if op[3] > 0]
    quantum = max(1, sum(op[2] for op in useful) // max(1, limit))
    for name, index, nbytes, flops in useful:
        grown = [(calls + ((name, index),), b + nbytes, f + flops) for calls, b, f in front]
        front = _pareto(front + grown, quantum, limit)
    return tuple((tuple(sorted(calls)), b, f) for calls, b, f in front if calls)


def _pareto(points: list[KeepSet], quantum: int, limit: int) -> list[KeepSet]:
    """The points that save more FLOPs than every point holding fewer bytes (on equal bytes, the one
    saving the most); above ``limit`` points, one per ``quantum`` bytes (the one saving the most) and the
    empty set."""
    out: list[KeepSet] = []
    for p in sorted(points, key=lambda p: (p[1], -p[2])):
        if not out or p[2] > out[-1][2]:
            out.append(p)
    if len(out) <= limit:
        return out
    cells: dict[int, KeepSet] = {}
    for p in out:
        cell = p[1] // quantum
        if cell not in cells or p[2] > cells[cell][2]:
            cells[cell] = p
    return [out[0], *(p for p in cells.values() if p is not out[0])]
