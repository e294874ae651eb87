"""Overhead of ``GradSyncGuard(every=1)`` as a fraction of step time: ``python -m benchmarks.guards``.

Two gloo CPU ranks train a ~20M-parameter GPT (``GPT`` of tests/models.py, every block checkpointed)
under DDP. Steps with and without ``guard.check()`` alternate (interleaved, so load changes on the
machine hit both alike); the overhead is the ratio of the median step times minus one. The time of
``check()`` itself is also timed on its own, after a barrier (median), and reported as a fraction of
the median step.
Writes ``benchmarks/results/guards.md``.
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

from benchmarks.ranks import run_ranks

RESULTS = Path(__file__).resolve().parent / "results"


def _config():  # noqa: ANN202 - tests/models.py imported lazily in the ranks
    from models import GPTConfig

    # ~20.9M parameters: 10 blocks of 384 wide, a 4096-token vocabulary.
    return GPTConfig(vocab=4096, seq=128, dim=384, heads=6, layers=10)


def _rank(rank: int, world: int, steps: int, batch_size: int) -> Any:
    # run_ranks set up the gloo group, with the cores shared out between the ranks.
    from models import GPT, batch

    import distckpt

    cfg = _config()
    torch.manual_seed(0)
    model = distckpt.wrap(GPT(cfg), "full")
    n_params = sum(p.numel() for p in model.parameters())
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    guard = distckpt.GradSyncGuard(ddp, every=1)
    idx, tgt = batch(cfg, batch_size, seed=rank)
    times: dict[bool, list[float]] = {False: [], True: []}
    check_times: list[float] = []
    for step in range(2 * steps + 2):
        guarded = step % 2 == 1
        dist.barrier()
        t0 = time.perf_counter()
        ddp(idx, tgt).backward()
        dist.barrier()  # in both kinds of steps: check() alone is then timed without the ranks' skew
        if guarded:
            t1 = time.perf_counter()
            guard.check()
            check_times.append(time.perf_counter() - t1)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()  # a step ends when the slowest rank ends it
        if step >= 2:  # warm-up: the first two steps allocate
            times[guarded].append(time.perf_counter() - t0)
    return n_params, times, check_times


def measure(steps: int, batch_size: int, world: int = 2) -> dict[str, float]:
    """Run the two ranks; return the medians and ratios (from rank 0)."""
    results = run_ranks(_rank, world, steps, batch_size)
    n_params, times, check_times = results[0]
    plain, guarded = statistics.median(times[False]), statistics.median(times[True])
    check = statistics.median(check_times)
    return {
        "params": n_params,
        "steps": steps,
        "plain_s": plain,
        "guarded_s": guarded,
        "overhead": guarded / plain - 1,
        "check_s": check,
        "check_fraction": check / plain,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15, help="steps of each kind (interleaved)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    args = parser.parse_args(argv)
    r = measure(args.steps, args.batch)
    cfg = _config()
    text = f"""# GradSyncGuard overhead (every=1)

`python -m benchmarks.guards --steps {args.steps} --batch {args.batch}`: 2 gloo CPU ranks, DDP, GPT with
{r["params"] / 1e6:.1f}M parameters ({cfg.layers} blocks of width {cfg.dim}, vocabulary {cfg.vocab}, sequence
{cfg.seq}, batch {args.batch} per rank), every block checkpointed, SGD. {args.steps} steps with and {args.steps}
without `guard.check()`, interleaved; medians. Machine: {platform.processor() or platform.machine()},
{os.cpu_count()} CPU cores, torch {torch.__version__}.

| | median step | |
|---|---|---|
| without the guard | {r["plain_s"] * 1e3:.0f} ms | |
| with `guard.check()` every step | {r["guarded_s"] * 1e3:.0f} ms | overhead {r["overhead"] * 100:+.2f}% |
| `guard.check()` alone | {r["check_s"] * 1e3:.1f} ms | {r["check_fraction"] * 100:.2f}% of a step |

The step-time ratio carries the noise of a shared machine; the time of `check()` alone is the
overhead proper (one float32 pass over each gradient for the sum of squares, one gemv for the
projection, one all-gather of 7 float64 per parameter tensor), timed after a barrier so that it does
not include one rank waiting for the other.
"""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "guards.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
