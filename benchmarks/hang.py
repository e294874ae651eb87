"""Cost of distckpt's guards against a hang under FSDP2: ``python -m benchmarks.hang``.

Two gloo CPU ranks train a small GPT (tests/models.py, every block checkpointed, each block its own FSDP2
unit: a short step, so that a fixed cost per step weighs more) built by ``distckpt.parallelize(model, "fsdp2")``.
Steps of three kinds alternate (interleaved, so load changes on the machine hit all alike): without the handshake
and the watchdog's feed, with the handshake only, and with both (the default). The overhead is the median, over the
rounds of three consecutive steps, of a step's time over the time of the round's step without them, minus one (the
ratio of the medians is reported too). The handshake alone (one all-reduce of 10 int64 on the gloo group, per
forward and per backward) and the watchdog's feed alone (an attribute write per phase and unit, timed over many
calls in one process) are also timed on their own.
Writes ``benchmarks/results/hang.md``.
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
KINDS = ("off", "handshake", "default")


def _config():  # noqa: ANN202 - models (tests/) imported lazily in the ranks
    from models import GPTConfig

    # 4.3M parameters: 6 blocks of 192 wide, a 4096-token vocabulary (most of it in the embedding and the head).
    return GPTConfig(vocab=4096, seq=128, dim=192, heads=6, layers=6)


def _rank(rank: int, world: int, steps: int, batch_size: int) -> Any:
    from models import GPT, batch

    import distckpt
    from distckpt.parallel.handshake import FORWARD

    cfg = _config()
    torch.manual_seed(0)
    model = distckpt.wrap(GPT(cfg), "full")
    n_params = sum(p.numel() for p in model.parameters())
    pm = distckpt.parallelize(model, "fsdp2")
    phases = pm._distckpt_sync.phases  # the benchmark switches the guards off and on between steps
    handshake, watchdog = phases.handshake, phases.watchdog
    opt = torch.optim.SGD(pm.parameters(), lr=1e-3)
    idx, tgt = batch(cfg, batch_size, seed=rank)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for step in range(3 * steps + 3):
        kind = KINDS[step % 3]
        phases.handshake = None if kind == "off" else handshake
        phases.watchdog = watchdog if kind == "default" else None
        dist.barrier()
        t0 = time.perf_counter()
        pm(idx, tgt).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.barrier()  # a step ends when the slowest rank ends it
        if step >= 3:  # warm-up: the first steps allocate
            times[kind].append(time.perf_counter() - t0)
    meets = []
    for _ in range(50):
        dist.barrier()
        t0 = time.perf_counter()
        handshake.meet(FORWARD, 0, 1, 0, True)
        meets.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    n = 100_000
    for _ in range(n):
        watchdog.enter("forward 1 of step 0", 300.0)
        watchdog.progress("blocks.0")
        watchdog.leave()
    feed = (time.perf_counter() - t0) / n
    return n_params, times, statistics.median(meets), feed


def measure(steps: int, batch_size: int, world: int = 2) -> dict[str, Any]:
    """Run the two ranks; return the medians and ratios (from rank 0)."""
    n_params, times, meet, feed = run_ranks(_rank, world, steps, batch_size)[0]
    med = {k: statistics.median(v) for k, v in times.items()}
    paired = {k: statistics.median(a / b for a, b in zip(times[k], times["off"])) - 1 for k in KINDS[1:]}
    cfg = _config()
    phases_per_step = 2 + cfg.layers  # a forward, a backward, and each block unit's progress
    return {
        "params": n_params,
        "median": med,
        "overhead": paired,
        "ratio_of_medians": {k: med[k] / med["off"] - 1 for k in KINDS[1:]},
        "meet_s": meet,
        "meet_fraction": 2 * meet / med["off"],  # two handshakes per step
        "feed_s": feed,
        "feed_fraction": phases_per_step * feed / med["off"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="steps of each kind (interleaved)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    args = parser.parse_args(argv)
    load0 = os.getloadavg()[1]
    r = measure(args.steps, args.batch)
    load = f"{load0:.1f} to {os.getloadavg()[1]:.1f}"  # 5-minute load averages, before and after
    cfg = _config()
    med, over, ratio = r["median"], r["overhead"], r["ratio_of_medians"]

    def pct(kind: str) -> str:
        return f"{over[kind] * 100:+.2f}% ({ratio[kind] * 100:+.2f}%)"

    meet, feed = f"{r['meet_s'] * 1e6:.0f}", f"{r['feed_s'] * 1e6:.2f}"
    text = f"""# Cost of the guards against a hang (FSDP2)

`python -m benchmarks.hang --steps {args.steps} --batch {args.batch}`: 2 gloo CPU ranks, `parallelize(model,
"fsdp2")`, GPT with {r["params"] / 1e6:.1f}M parameters ({cfg.layers} blocks of width {cfg.dim}, each checkpointed
and its own FSDP2 unit; vocabulary {cfg.vocab}, sequence {cfg.seq}, batch {args.batch} per rank), SGD. {args.steps}
steps of each kind, interleaved; medians. Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU
cores (load average {load} while it ran), torch {torch.__version__}.

| steps | median step | against FSDP2 without them (paired; ratio of medians) |
|---|---|---|
| without the handshake and the watchdog's feed | {med["off"] * 1e3:.0f} ms | |
| with the handshake | {med["handshake"] * 1e3:.0f} ms | {pct("handshake")} |
| with both (the default) | {med["default"] * 1e3:.0f} ms | {pct("default")} |
| one handshake alone (after a barrier; two per step) | {meet} µs | {r["meet_fraction"] * 100:.3f}% of a step |
| the watchdog's feed alone (enter, progress, leave) | {feed} µs | {r["feed_fraction"] * 100:.4f}% of a step |

The step-time ratios carry the noise of a shared machine (2 cores, other jobs); the handshake's own time is the
overhead proper: one all-reduce of 10 int64 on a gloo group (on a GPU job, a CPU group: it never waits for the GPU
stream), at the start of each forward and each backward. The watchdog's thread looks every
min(10 s, hang_timeout / 10) and runs no collective; it reads the c10d store only then.
"""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "hang.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
