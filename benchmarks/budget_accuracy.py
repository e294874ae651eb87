"""How close the budget planner's predicted peak is to the measured one: ``python -m benchmarks.budget_accuracy``.

For each model and a few choices of checkpointed blocks (none, every other, all), the predicted peak
(:func:`distckpt.select.budget.predicted_peak`, AdamW, one process) is compared with the MemTracker
peak of a real training step in steady state (forward, backward, ``optimizer.step``,
``zero_grad(set_to_none=True)``, after a first step created the optimizer state). Then the same on 2
gloo ranks under ``distckpt.parallelize`` (DDP, FSDP, FSDP2), each rank's peak against its prediction.
Writes ``benchmarks/results/budget_accuracy.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

import distckpt
from distckpt.select.blocks import find_blocks
from distckpt.select.budget import predicted_peak
from distckpt.select.profile import Call, as_args, memory_tracker, profile_model, scalar_loss

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


class Subset:
    def __init__(self, chosen: list[int]):
        self.chosen = chosen

    def select(self, candidates: Any) -> list[int]:
        return self.chosen


class Tower(nn.Module):
    def __init__(self, d_in: int, d: int, layers: int, out: int):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, 2, 2 * d, dropout=0.0, batch_first=True) for _ in range(layers)
        )
        self.proj = nn.Linear(d, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.proj(h.mean(1))


class TwoTower(nn.Module):
    """CLIP-like: an image tower and a text tower of different widths, a contrastive loss."""

    def __init__(self):
        super().__init__()
        self.image = Tower(48, 64, 3, 32)
        self.text = Tower(16, 32, 3, 32)

    def forward(self, pixels: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        a = nn.functional.normalize(self.image(pixels), dim=-1)
        b = nn.functional.normalize(self.text(tokens), dim=-1)
        logits = a @ b.t() / 0.07
        target = torch.arange(len(a))
        return (nn.functional.cross_entropy(logits, target) + nn.functional.cross_entropy(logits.t(), target)) / 2


def _models() -> dict[str, tuple[Callable[[], nn.Module], Callable[[], Any], Any]]:
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "unit")]
    from test_budget_measured import Chain, _is_block  # noqa: PLC0415 - the test's heterogeneous model
    from zoo import FAMILIES  # noqa: PLC0415

    from distckpt.train.models import MultiTaskGPT, MultiTaskMLP

    def zoo(name: str):
        fam = FAMILIES[name]
        return (lambda: fam.build(), lambda: Call((), fam.batch(0)), None)

    from benchmarks.models import GPT, SIZES, Block, batch

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
            _is_block,
        ),
    }


def steady_peak(model: nn.Module, inputs: Any) -> int:
    """MemTracker peak of one AdamW step after a first step created the optimizer state."""
    args, kwargs = as_args(inputs)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    for measure in (False, True):
        mt = memory_tracker(model, opt)
        if measure:
            mt.__enter__()
        scalar_loss(model(*args, **kwargs)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if measure:
            mt.__exit__(None, None, None)
    return mt.get_tracker_snapshot("peak")[CPU]["Total"]


def _profiled(
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
    base, mp, placements = _profiled(make, inputs, blocks)
    rows = []
    for label, chosen in placements:
        model = copy.deepcopy(base)
        distckpt.wrap(model, Subset(chosen), blocks=blocks)
        rows.append((label, predicted_peak(mp, chosen, strategy="none", optimizer="adamw"), steady_peak(model, inputs)))
    return rows


NOTES = [
    "Notes:",
    "- DDP: the reducer's flat gradient bucket (allocated in C++, rebuilt in the second step's forward, kept "
    "after) is tracked as an external tensor from the step's start; MemTracker alone sees it only from the "
    "first gradient copied into it in backward. The prediction counts it as one more gradient-sized buffer.",
    "- FSDP/FSDP2: parallelize makes every block its own unit, checkpointed or not. The model counts, phase "
    "by phase, what FSDP holds unsharded beside the shards (distckpt/select/budget/memory_terms.py `_Sharded`, "
    "measured per module and phase with MemTracker and read off torch's FSDP code): a block's parameters (FSDP2: "
    "and its "
    "all-gather output) in its forward; in its backward its own and the prefetched previous block's parameters, "
    "FSDP2 the reduce-scatter input of the block whose backward came before, and the gradients made so far "
    "unsharded (the block's own and the root unit's); the last block's parameters during the head. Counting "
    "two blocks' parameters and one block's gradients at every peak (before) was 4.6-10.6% high, and 1.2-1.3% "
    "low under FSDP2 with a checkpointed block next to a kept one (its own gradients counted as shards).",
    "- FSDP1: MemTracker follows its in-place storage resizes: on MultiTaskMLP the peak of the CPU allocator's "
    "events (torch.profiler, profile_memory) equals MemTracker's with no block checkpointed; with checkpointing "
    "the allocator also sees up to one 5056-byte CPU RNG state per checkpointed block (checkpoint's, made in "
    "C++: MemTracker misses it under every strategy) and, varying from run to run, gloo's own buffers. The "
    "rows stay MemTracker's.",
    "- MultiTaskMLP rows are 0.5-1% high under every strategy: the prediction counts the batch, which this "
    "measure does not track.",
    "- FSDP1 concatenates a unit's parameter gradients (one autograd output per parameter view) into its flat "
    "gradient at the end of the unit's backward, both alive at once (`memory_terms._flat_gradients`): before it was "
    "counted, gpt2 (HF) under FSDP1 was 0.2% (5.5 KB) under, and 1.9-2.3% under with accumulation.",
    "- Rows with 2 micro-batches (`distckpt.accumulate` around the first): every gradient exists from the "
    "first micro-batch on, so a block's term takes the activations' own peak in its backward (a new gradient "
    "is a temporary until its in-place add; `BlockProfile.accumulating_overhead_bytes`), with the gradients "
    "the last micro-batch has reduce-scattered already sharded (`memory_terms._settled`) and, under FSDP1, the root "
    "unit's head gradients as view temporaries. Before: gpt2 (HF) FSDP2 -1.1% (none) and +3.2% (all), "
    "MultiTaskGPT FSDP1 -0.4..-0.6%.",
    "- Inputs every block takes (HF GPT-2's `cache_position` and mask, Llama's mask and rotary tables) are "
    "held once however many checkpointed blocks keep them (`BlockProfile.shared_input_bytes`): llama + LoRA "
    "every other / all were +2.65% / +2.49%.",
    "- The distributed rows were under by 23-700 B (at most 0.03%). Most of it was this benchmark's: the "
    "DDP bucket capture also held distckpt's own integer all-reduce of the used bits (55 B under DDP, 536 B "
    "under FSDP/FSDP2 on MultiTaskGPT, with the units' forward counts), tracked from the step's start; only "
    "floating-point buckets are tracked now. The model's: FSDP1's flat-gradient bound was lowered by the "
    "inputs an earlier checkpointed block holds (gpt2 (HF) 640 B: its mask and `cache_position`), and "
    "parallelize's per-parameter SyncState tensors (5 B per parameter, which MemTracker meets before the "
    "peak under accumulation) were not counted. Still under, not explained yet: MultiTaskGPT FSDP1, 2 "
    "micro-batches, every block checkpointed, by 92-156 B (its recompute's measured overhead 256 B below the "
    "kept block's), and gpt2 (HF) DDP, 2 micro-batches, every other block checkpointed, by 288 B (640 B below "
    "the other placements' margin: the shared inputs again).",
    "- CLIP (HF) (tests/zoo.py: two towers of 2 layers, the text tower registered first, the vision tower "
    'run first): profiled in registration order (issue 26), "every other" was +3.87% (none and all '
    "+0.91%), and with forward and backward alone (test_zoo's measure) every subset of full was predicted "
    "-3.9% to +19.3% and budgets between the two peaks were exceeded by up to 0.88%. The blocks are now "
    "profiled and planned in the order they run (`ModelProfile.run_order`). The +0.91% left is the batch "
    "(25 KB, mostly images), which the prediction counts and this measure does not track (as for "
    "MultiTaskMLP).",
]
STRATEGIES = ("ddp", "fsdp", "fsdp2")
DIST_MODELS = ("MultiTaskGPT", "MultiTaskMLP", "gpt2 (HF)")


def _ddp_buckets(step: Callable[[], None]) -> list[torch.Tensor]:
    """Run ``step`` and return the flat gradient buckets DDP's reducer all-reduced in it. The reducer
    allocates them in C++ (rebuilt in the second step's forward) and keeps them for the rest of training;
    MemTracker only sees a bucket once an op in backward writes into it (the gradient copy-in), so a
    peak in forward or before the first gradient would miss it: they are tracked as external tensors.

    Only floating-point tensors are buckets: the integer and bool ones are distckpt's own per-step
    all-reduce of the used bits (and, under FSDP, the units' forward counts; ``param_sync._reduce_window``),
    a temporary made after the backward's peak. Held here, it was tracked from the step's start: the
    measured peak was 55 B (DDP) and 536 B (FSDP, FSDP2) high on MultiTaskGPT, which read as the
    prediction being under."""
    from distckpt import _torch_compat as compat

    seen: dict[int, torch.Tensor] = {}

    class _Buckets(compat.torch_dispatch_mode()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "allreduce" in str(func):
                for t in _tensors(args):
                    if t.is_floating_point():
                        seen.setdefault(id(t.untyped_storage()), t)
            return func(*args, **(kwargs or {}))

    with _Buckets():
        step()
    return list(seen.values())


def _tensors(value: Any) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def dist_steady_peak(model: nn.Module, strategy: str, inputs: Any, micro_batches: int = 1) -> int:
    """This rank's MemTracker peak of a steady-state AdamW step under ``distckpt.parallelize(strategy)``
    (DDP's buckets counted from the step's start, see :func:`_ddp_buckets`); with ``micro_batches > 1``
    gradients are accumulated (``distckpt.accumulate`` around all but the last micro-batch)."""
    args, kwargs = as_args(inputs)
    pm = distckpt.parallelize(model, strategy)
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-4)

    def step(mt: Any = None) -> None:
        for k in range(micro_batches):
            with distckpt.accumulate(pm) if k < micro_batches - 1 else contextlib.nullcontext():
                scalar_loss(pm(*args, **kwargs)).backward()
            if mt is not None and k < micro_batches - 1:
                mt.reset_mod_stats()  # MemTracker refuses a module's second forward otherwise; its peak stays
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    buckets = _ddp_buckets(step)  # the second step: DDP rebuilds its buckets in its forward
    mt = memory_tracker(pm, opt, *buckets)
    with mt:
        step(mt)
    return mt.get_tracker_snapshot("peak")[CPU]["Total"]


def _dist_rank(
    rank: int,
    world: int,
    names: tuple[str, ...],
    strategies: tuple[str, ...],
    micro_batches: int = 1,
    labels: tuple[str, ...] | None = None,
) -> list[tuple]:
    """This rank's ``(where, placement, predicted, measured)`` rows (``labels``: only those placements)."""
    rows = []
    models = _models()
    for name in names:
        make, inputs, blocks = models[name]
        inp = inputs()
        base, mp, placements = _profiled(make, inp, blocks)
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


def measure_dist(
    names: tuple[str, ...] = DIST_MODELS, strategies: tuple[str, ...] = STRATEGIES, micro_batches: int = 1
) -> list[tuple[str, str, int, int]]:
    """``[(model and strategy, checkpointed, predicted, measured)]`` on 2 gloo ranks: the largest
    error over the ranks is kept (each rank predicts and measures its own peak); ``micro_batches > 1``:
    gradients accumulated over that many (:func:`dist_steady_peak`)."""
    from benchmarks.ranks import run_ranks

    per_rank = run_ranks(_dist_rank, 2, tuple(names), tuple(strategies), micro_batches)
    worst = []
    for rows in zip(*per_rank.values()):
        worst.append(max(rows, key=lambda r: abs(r[2] - r[3]) / r[3]))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "budget_accuracy.md"))
    ap.add_argument("--only", nargs="*", default=None)
    a = ap.parse_args()
    lines = [
        "# Budget planner: predicted vs measured peak (CPU, MemTracker, AdamW steady-state step)",
        "",
        f"torch {torch.__version__}; error = (predicted - measured) / measured.",
        "",
        "| model | checkpointed | predicted | measured | error |",
        "|---|---|---|---|---|",
    ]
    worst = 0.0
    for name, (make, inputs, blocks) in _models().items():
        if a.only and name not in a.only:
            continue
        for label, pred, meas in measure(name, make, inputs(), blocks):
            err = (pred - meas) / meas
            worst = max(worst, abs(err))
            lines.append(f"| {name} | {label} | {pred / 2**20:.3f} MiB | {meas / 2**20:.3f} MiB | {100 * err:+.2f}% |")
            print(lines[-1], flush=True)
    if not a.only or "dist" in a.only:
        rows = measure_dist() + measure_dist(micro_batches=2)
        for name, label, pred, meas in rows:
            err = (pred - meas) / meas
            worst = max(worst, abs(err))
            lines.append(f"| {name} | {label} | {pred / 2**20:.3f} MiB | {meas / 2**20:.3f} MiB | {100 * err:+.2f}% |")
            print(lines[-1], flush=True)
    lines += ["", f"Largest error: {100 * worst:.2f}%.", "", *NOTES]
    Path(a.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
