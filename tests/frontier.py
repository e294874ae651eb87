"""The memory benchmark's frontier (benchmarks/memory.py): its configurations, the budget sizes it measures
(evenly between the smallest the budget accepts and no checkpointing, and at every other point's peak), and
which points a budget point dominates on both axes (peak memory, recompute FLOPs). Here, beside the tests'
fixtures, so that tests/unit/test_bench_memory.py checks it without importing the benchmark.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

import distckpt

# Peer points count as dominated by the budget frontier when a budget point is at most this much
# (fraction of the no-checkpointing peak, and of forward+backward FLOPs) above them on both axes.
TOLERANCE = 0.001


@dataclass
class Config:
    """One point of the benchmark: how checkpointing is applied, and what was measured of it."""

    name: str
    build: Callable[[nn.Module], nn.Module]  # applies checkpointing to a fresh copy of the model
    kind: str = "distckpt"  # "distckpt", "budget", "peer" (torch / HF), "compile"
    peer: str = ""  # the config it is compared with at the same placement
    budget: int | None = None
    at: str = ""  # budget points sized at another point's measured peak: that point's name
    error: str = ""
    model: nn.Module | None = None
    peak: int = 0
    mem_tracker: int | None = None  # MemTracker's peak (eager rows on CPU), a check of ``peak``
    flops: int = 0
    times: list[float] = field(default_factory=list)
    checkpointed: str = "0"


def budget_configs(smallest: int, none_peak: int, example: Any, points: int, others: list[Config]) -> list[Config]:
    """``budget:SIZE`` at ``points`` sizes evenly from the smallest accepted to the peak of none, and
    at the measured peak of every other point (peers and distckpt's fixed policies) that it accepts:
    given the same memory as that point, does the budget need no more recompute?"""
    top = max(none_peak, smallest)
    sizes = {smallest + (top - smallest) * k // (points - 1): "" for k in range(points)}
    for c in sorted(others, key=lambda c: c.peak):
        if not c.error and c.peak >= smallest:
            sizes[c.peak] = " = ".join(filter(None, (sizes.get(c.peak), c.name)))
    return [
        Config(
            f"budget {size / 2**20:.2f} MiB",
            lambda m, size=size: distckpt.wrap(m, f"budget:{size}", example_inputs=example),
            kind="budget",
            budget=size,
            at=at,
        )
        for size, at in sorted(sizes.items())
    ]


def dominated_by(point: Config, frontier: list[Config], none_peak: int, fwd_bwd_flops: int) -> Config | None:
    """The budget point with the least recompute among those at most ``TOLERANCE`` above
    ``point`` in both peak and recompute FLOPs, or None."""
    fits = [
        b
        for b in frontier
        if b.peak <= point.peak + TOLERANCE * none_peak and b.flops <= point.flops + TOLERANCE * fwd_bwd_flops
    ]
    return min(fits, key=lambda b: (b.flops, b.peak), default=None)


def at_its_peak(point: Config, frontier: list[Config], none: Config, fwd_bwd_flops: int) -> str:
    """What the budget point sized at ``point``'s measured peak got (why ``point`` is not dominated)."""
    b = next((b for b in frontier if point.name in b.at.split(" = ")), None)
    if b is None:
        return ""
    return (
        f": {b.name}, sized at its peak, measured {b.peak / none.peak:.1%} at {b.flops / fwd_bwd_flops:.1%} recompute"
    )


def dominance(label: str, configs: list[Config], fwd_bwd_flops: int) -> list[str]:
    """The markdown lines saying, for each point but the budget's and ``none``, which budget point dominates
    or equals it (:func:`dominated_by`), and how many of the peers' points (torch, HF, torch.compile) are."""
    none = next(c for c in configs if c.name == "none")
    frontier = [c for c in configs if c.kind == "budget" and not c.error]
    others = [c for c in configs if c.kind in ("peer", "compile", "distckpt") and c.name != "none" and not c.error]
    rows, peers_ok = [], 0
    for c in others:
        b = dominated_by(c, frontier, none.peak, fwd_bwd_flops)
        if c.kind != "distckpt":
            peers_ok += b is not None
        verdict = (
            f"yes: {b.name} ({b.peak / none.peak:.1%}, {b.flops / fwd_bwd_flops:.1%})"
            if b
            else "**no**" + at_its_peak(c, frontier, none, fwd_bwd_flops)
        )
        rows.append(f"| {c.name} | {c.peak / none.peak:.1%} | {c.flops / fwd_bwd_flops:.1%} | {verdict} |")
    n_peers = sum(1 for c in others if c.kind != "distckpt")
    return [
        f"Budget frontier vs every other point ({label.split(':')[0]}): dominates or equals "
        f"**{peers_ok} of {n_peers}** peer points (torch, HF, torch.compile).",
        "",
        "| point | peak vs none | recompute (% of fwd+bwd) | a budget point at or below it on both |",
        "|---|---|---|---|",
        *rows,
        "",
    ]
