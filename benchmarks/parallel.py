"""Step time of ``distckpt.parallelize(graph="auto")`` against the best hand-picked valid DDP flags:
``python -m benchmarks.parallel``.

Two gloo CPU ranks train a ~20M-parameter multi-task GPT (``Block`` trunk of tests/models.py, every
block checkpointed, three task heads) in two patterns:

- ``all heads``: every head in the loss every step. Best hand-picked valid flags: plain DDP
  (``find_unused_parameters=False``), the fastest setting, valid here because nothing is unused.
- ``sampled head``: each rank computes only the head of the task it sampled. Best hand-picked valid
  flags: ``find_unused_parameters=True`` (valid for one forward with non-reentrant checkpointing).

Both models are built on the same ranks with the same init; their steps alternate (interleaved, so
load on the shared machine hits both alike); the figure is the ratio of median step CPU times
(summed over the ranks), with the wall-time ratio next to it.
Writes ``benchmarks/results/parallel.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.ranks import run_ranks

RESULTS = Path(__file__).resolve().parent / "results"
TASKS = ("a", "b", "c")


def _config():  # noqa: ANN202 - tests/models.py imported lazily in the ranks
    from models import GPTConfig

    # ~19.5M parameters: 10 blocks of width 384, a 4096-token vocabulary, three 256-way heads.
    return GPTConfig(vocab=4096, seq=128, dim=384, heads=6, layers=10)


class MultiTaskGPT(nn.Module):
    """A GPT trunk with one classification head per task; ``forward(idx, tasks)`` runs only those heads."""

    def __init__(self, cfg, n_classes: int = 256):  # noqa: ANN001
        super().__init__()
        from models import Block

        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.heads = nn.ModuleDict({t: nn.Linear(cfg.dim, n_classes) for t in TASKS})

    def forward(self, idx: torch.Tensor, tasks: tuple[str, ...] = TASKS) -> dict[str, torch.Tensor]:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return {t: self.heads[t](x) for t in tasks}


def _loss(model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor, tasks: tuple[str, ...]) -> torch.Tensor:
    out = model(idx, tasks)
    return sum(F.cross_entropy(out[t].flatten(0, 1), tgt.flatten() % out[t].shape[-1]) for t in tasks)


PATTERNS = {
    # name: (tasks of (step, rank), hand-picked DDP flags)
    "all heads": (lambda step, rank: TASKS, {"find_unused_parameters": False}),
    "sampled head": (lambda step, rank: (TASKS[(step + rank) % 3],), {"find_unused_parameters": True}),
}


def _rank(rank: int, world: int, steps: int, batch_size: int) -> Any:
    # run_ranks set up the gloo group, with the cores shared out between the ranks.
    from models import batch

    import distckpt

    cfg = _config()
    idx, tgt = batch(cfg, batch_size, seed=rank)
    results = {}
    for name, (tasks_of, flags) in PATTERNS.items():
        models = {}
        for kind in ("auto", "hand"):
            torch.manual_seed(0)
            model = distckpt.wrap(MultiTaskGPT(cfg), "full", blocks="h.*")
            if kind == "auto":
                pm = distckpt.parallelize(model, "ddp", graph="auto")
            else:
                pm = torch.nn.parallel.DistributedDataParallel(model, **flags)
            models[kind] = (pm, torch.optim.AdamW(pm.parameters(), lr=1e-4, weight_decay=0.1))
        n_params = sum(p.numel() for p in models["auto"][0].parameters())
        times: dict[str, list[float]] = {"auto": [], "hand": []}
        cpu: dict[str, list[float]] = {"auto": [], "hand": []}
        for step in range(2 * steps + 4):
            # ABBA order: neither kind always runs right after the other.
            kind = ("auto", "hand", "hand", "auto")[step % 4]
            pm, opt = models[kind]
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            _loss(pm, idx, tgt, tasks_of(step // 2, rank)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            c1 = time.process_time()
            dist.barrier()  # a step ends when the slowest rank ends it
            if step >= 4:  # warm-up: the first steps allocate
                times[kind].append(time.perf_counter() - t0)
                # CPU time of the rank's process (its gloo threads included): what the step costs,
                # without the time it waited for a core on a shared machine. Summed over ranks below.
                cpu[kind].append(c1 - c0)
        results[name] = (n_params, times, cpu)
        del models
    return results


def measure(steps: int, batch_size: int, world: int = 2) -> dict[str, dict[str, float]]:
    """Run the two ranks; return, per pattern, the medians and their ratio (from rank 0)."""
    results = run_ranks(_rank, world, steps, batch_size, timeout=7200)
    summary = {}
    for name, (n_params, times, _) in results[0].items():
        auto, hand = statistics.median(times["auto"]), statistics.median(times["hand"])
        cpu = {
            k: statistics.median(sum(r[name][2][k][i] for r in results.values()) for i in range(len(times[k])))
            for k in ("auto", "hand")
        }
        summary[name] = {
            "params": n_params,
            "auto_s": auto,
            "hand_s": hand,
            "ratio": auto / hand,
            "auto_cpu": cpu["auto"],
            "hand_cpu": cpu["hand"],
            "cpu_ratio": cpu["auto"] / cpu["hand"],
        }
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps of each kind per pattern (interleaved)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    args = parser.parse_args(argv)
    r = measure(args.steps, args.batch)
    cfg = _config()
    n_params = next(iter(r.values()))["params"]
    rows = "\n".join(
        f"| {name} | `{PATTERNS[name][1]}` | {v['hand_cpu'] * 1e3:.0f} ms | {v['auto_cpu'] * 1e3:.0f} ms | "
        f"**{v['cpu_ratio']:.3f}** ({(v['cpu_ratio'] - 1) * 100:+.1f}%) | {v['hand_s'] * 1e3:.0f} ms | "
        f"{v['auto_s'] * 1e3:.0f} ms | {v['ratio']:.3f} |"
        for name, v in r.items()
    )
    header = (
        "| pattern | best hand-picked valid DDP flags | CPU time, hand-picked | CPU time, `auto` | CPU ratio "
        "| wall, hand-picked | wall, `auto` | wall ratio |"
    )
    text = f"""# DDP overhead of `distckpt.parallelize(graph="auto")`

`python -m benchmarks.parallel --steps {args.steps} --batch {args.batch}`: 2 gloo CPU ranks, DDP, a multi-task
GPT with {n_params / 1e6:.1f}M parameters ({cfg.layers} blocks of width {cfg.dim}, vocabulary {cfg.vocab}, sequence
{cfg.seq}, three 256-way task heads, batch {args.batch} per rank), every block checkpointed (non-reentrant),
AdamW. Per pattern, {args.steps} steps of each model, interleaved (ABBA); medians. Machine:
{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}.

{header}
|---|---|---|---|---|---|---|---|
{rows}

CPU time is the process CPU time of a step summed over both ranks (median): the cost of the step,
free of the time a rank waits for a core. Wall time (rank 0, between barriers) is reported too; on
this shared 2-core machine it swings by tens of percent between runs, in both directions.

What `auto` adds per step: one walk of the new autograd graph per forward (Python, a few hundred
nodes), one identity autograd node per model output, zero gradients (expanded scalars) for the
parameters the step does not use, and one all-reduce of one byte per parameter tensor. The ratio
carries the noise of a shared machine.
"""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "parallel.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
