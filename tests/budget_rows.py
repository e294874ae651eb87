"""The budget planner's predicted peak against a measured one, row by row: the models (one process and 2
ranks), the placements every row measures (none, every other block, all), and each row's prediction and
MemTracker peak of a steady-state AdamW step (tests/peaks.py). Shared by tests/unit/test_budget_accuracy.py,
test_budget_dist.py and the benchmark that reports every model (benchmarks/budget_accuracy.py).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from models import GPT, SIZES, Block, Chain, TwoTower, batch, is_chain_block
from peaks import dist_steady_peak, steady_peak

import distckpt
from distckpt.select import KeepOps
from distckpt.select.blocks import find_blocks
from distckpt.select.budget import predicted_peak
from distckpt.select.budget.op_sets import keep_sets
from distckpt.select.profile import Call, profile_model


class Subset:
    """A policy checkpointing exactly the given blocks (by index)."""

    def __init__(self, chosen: list[int]):
        self.chosen = chosen

    def select(self, candidates: Any) -> list[int]:
        return self.chosen


def accuracy_models() -> dict[str, tuple[Callable[[], nn.Module], Callable[[], Any], Any]]:
    """``{name: (make the model, make its inputs, blocks=)}`` of every model the rows measure."""
    from zoo import FAMILIES

    from distckpt.train.models import MultiTaskGPT, MultiTaskMLP

    def zoo(name: str):
        fam = FAMILIES[name]
        return (lambda: fam.build(), lambda: Call((), fam.batch(0)), None)

    g = torch.Generator().manual_seed(0)
    return {
        # benchmarks/memory.py's "GPT small" (seq 128, vocab 512, 8 layers), batch 2 as there.
        "GPT small (memory benchmark)": (lambda: GPT(SIZES["small"]), lambda: batch(SIZES["small"], 2), Block),
        "MultiTaskGPT": (
            lambda: MultiTaskGPT(),
            lambda: (
                {"tokens": torch.randint(0, 64, (4, 32), generator=g), "label": torch.randint(0, 4, (4,), generator=g)},
            ),
            None,
        ),
        "MultiTaskMLP": (
            lambda: MultiTaskMLP(),
            lambda: (
                {
                    "x": torch.randn(64, 32, generator=g),
                    "y_a": torch.randint(0, 10, (64,), generator=g),
                    "y_b": torch.randint(0, 2, (64,), generator=g),
                },
            ),
            None,
        ),
        "gpt2 (HF)": zoo("gpt2"),
        "llama (HF)": zoo("llama"),
        "llama + LoRA": zoo("llama_lora"),
        "CLIP (HF)": zoo("clip"),
        "two-tower (CLIP-like)": (
            TwoTower,
            lambda: (torch.randn(8, 16, 48, generator=g), torch.randn(8, 12, 16, generator=g)),
            nn.TransformerEncoderLayer,
        ),
        "heterogeneous MLP chain": (
            lambda: Chain((16, 128, 32, 96, 24, 64)),
            lambda: (torch.randn(512, 8, generator=g),),
            is_chain_block,
        ),
    }


def profiled(
    make: Callable[[], nn.Module], inputs: Any, blocks: Any
) -> tuple[nn.Module, Any, list[tuple[str, list[int]]]]:
    """The model (seeded, in training mode), its profile, and the placements every row measures."""
    torch.manual_seed(0)
    base = make()
    base.train()
    candidates = find_blocks(base, blocks)
    n = len(candidates)
    placements = [("none", []), ("every other", list(range(0, n, 2))), ("all", list(range(n)))]
    # MemTracker does not see the CPU RNG state each checkpointed block saves (5056 B, which the plan
    # counts and the allocator holds): compared with it, the prediction leaves that state out.
    mp = dataclasses.replace(profile_model(base, candidates, inputs), rng_state_bytes=0)
    return base, mp, placements


def measure(name: str, make: Callable[[], nn.Module], inputs: Any, blocks: Any) -> list[tuple[str, int, int]]:
    """``[(placement, predicted, measured)]`` in one process (no strategy), AdamW."""
    base, mp, placements = profiled(make, inputs, blocks)
    rows = []
    for label, chosen in placements:
        model = copy.deepcopy(base)
        distckpt.wrap(model, Subset(chosen), blocks=blocks)
        rows.append((label, predicted_peak(mp, chosen, strategy="none", optimizer="adamw"), steady_peak(model, inputs)))
    return rows


def dist_rows(
    rank: int,
    world: int,
    names: tuple[str, ...],
    strategies: tuple[str, ...],
    micro_batches: int = 1,
    labels: tuple[str, ...] | None = None,
) -> list[tuple]:
    """This rank's ``(where, placement, predicted, measured)`` rows (``labels``: only those placements)."""
    rows = []
    models = accuracy_models()
    for name in names:
        make, inputs, blocks = models[name]
        inp = inputs()
        base, mp, placements = profiled(make, inp, blocks)
        for strategy in strategies:
            for label, chosen in placements:
                if labels is not None and label not in labels:
                    continue
                model = copy.deepcopy(base)
                distckpt.wrap(model, Subset(chosen), blocks=blocks)
                pred = predicted_peak(
                    mp,
                    chosen,
                    strategy=strategy,
                    world_size=world,
                    optimizer="adamw",
                    grad_accumulation=micro_batches > 1,
                )
                accum = f", {micro_batches} micro-batches" if micro_batches > 1 else ""
                where = f"{name}, {strategy}, 2 ranks{accum}"
                rows.append((where, label, pred, dist_steady_peak(model, strategy, inp, micro_batches)))
    return rows


# A plan's neighbours (benchmarks/frontier.py's check of how close a plan is to the measured optimum).
def choices_of(b: Any) -> list[tuple[str | KeepOps, int, int]]:
    """Every choice the profile offers block ``b``: ``(mode, bytes held, recompute FLOPs)``."""
    out: list[tuple[str | KeepOps, int, int]] = [("none", b.activation_bytes, 0)]
    for mode in ("pointwise", "selective", "full"):
        held, flops = b.mode_held_flops(mode)
        if held >= 0:
            out.append((mode, held, flops))
    for calls, nbytes, saved in keep_sets(b.recompute_ops):
        out.append((KeepOps(calls), b.input_bytes + nbytes, max(0, b.full_flops - saved)))
    return out


def call_name(op: str, index: int) -> str:
    """An op call as the tables write it: ``("aten.addmm.default", 0)`` -> ``addmm #0``."""
    return f"{op.split('.')[1]} #{index}"


def mode_name(mode: str | KeepOps) -> str:
    """A mode as the tables write it: a :class:`KeepOps` with the calls it keeps (``ops[addmm #0, ...]``)."""
    if not isinstance(mode, KeepOps):
        return mode
    return "ops[" + ", ".join(call_name(n, i) for n, i in mode.calls) + "]"


def step_down(mode: str | KeepOps, b: Any) -> tuple[str | KeepOps, int] | None:
    """The choice of block ``b`` that recomputes less than ``mode`` at the fewest bytes held (on ties, the least
    recompute), with its bytes beyond ``mode``'s; ``None`` when none recomputes less."""
    options = choices_of(b)
    here = next((o for o in options if o[0] == mode), None)
    if here is None:  # a kept set off the front (merged): its own bytes and FLOPs
        cost = {(n, i): (nb, fl) for n, i, nb, fl in b.recompute_ops}
        calls = mode.calls if isinstance(mode, KeepOps) else ()
        here = (mode, b.input_bytes + sum(cost[c][0] for c in calls), b.full_flops - sum(cost[c][1] for c in calls))
    less = [o for o in options if o[2] < here[2]]
    if not less:
        return None
    m, held, _ = min(less, key=lambda o: (o[1], o[2]))
    return m, held - here[1]
