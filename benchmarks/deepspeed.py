"""The cost of distckpt's state on a DeepSpeed ZeRO engine: ``python -m benchmarks.deepspeed``.

Two gloo CPU ranks (``DS_ACCELERATOR=cpu``) train the multi-task GPT of ``benchmarks.parallel`` (every block
checkpointed, every head in the loss: the pattern DeepSpeed alone trains exactly, so both sides do the same work)
under ZeRO-2 and ZeRO-3, three engines side by side from the same initialisation:

- deepspeed: ``distckpt.wrap`` then ``deepspeed.initialize`` (DeepSpeed's own reduction, from its hooks);
- distckpt: ``distckpt.integrations.deepspeed.initialize`` (the zero-weight join in the root's forward, one
  presence all-reduce per backward, the gradients handed to ZeRO in parameter order at the end of backward);
- static: the same with ``graph="static"`` (no join, DeepSpeed's own reduction from its hooks, the used set checked).

Their steps alternate (ABCCBA, a barrier around each step, so load on the shared machine hits all alike); the figures
are ratios of median step times (wall: rank 0; CPU: the process's CPU time, summed over the ranks), the first steps
dropped. Writes ``benchmarks/results/deepspeed.md``.
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

from benchmarks.parallel import TASKS, MultiTaskGPT, _loss
from benchmarks.ranks import run_ranks

RESULTS = Path(__file__).resolve().parent / "results"
WARMUP = 4  # steps per side not timed (allocation, DeepSpeed's first-step bookkeeping and ZeRO-3's trace)
SIDES = ("deepspeed", "distckpt", "static")
ORDER = (0, 1, 2, 2, 1, 0)  # ABCCBA


def _engine(side: str, cfg: Any, stage: int, batch_size: int) -> Any:
    import deepspeed

    import distckpt
    from distckpt.integrations import deepspeed as dc_deepspeed

    torch.manual_seed(0)
    model = MultiTaskGPT(cfg)
    config = {
        "train_micro_batch_size_per_gpu": batch_size,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage},
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)  # torch's: no DeepSpeed op build on CPU
    if side != "deepspeed":
        graph = "static" if side == "static" else "auto"
        return dc_deepspeed.initialize(model, blocks="h.*", graph=graph, optimizer=opt, config=config)[0]
    distckpt.wrap(model, "full", blocks="h.*")
    return deepspeed.initialize(model=model, optimizer=opt, config=config)[0]


def _rank(rank: int, world: int, steps: int, batch_size: int, dim: int, layers: int) -> Any:
    os.environ["DS_ACCELERATOR"] = "cpu"
    from models import GPTConfig, batch

    from distckpt.integrations import deepspeed as dc_deepspeed

    dc_deepspeed.skip_cpu_comm_build()
    cfg = GPTConfig(vocab=4096, seq=128, dim=dim, heads=4, layers=layers)
    idx, tgt = batch(cfg, batch_size, seed=rank)
    out = {}
    for stage in (2, 3):  # ZeRO-3 replaces F.linear for the whole process: after ZeRO-2's runs
        engines = {side: _engine(side, cfg, stage, batch_size) for side in SIDES}
        n_params = sum(int(getattr(p, "ds_numel", p.numel())) for p in engines["distckpt"].module.parameters())
        wall: dict[str, list[float]] = {s: [] for s in SIDES}
        cpu: dict[str, list[float]] = {s: [] for s in SIDES}
        for step in range(len(SIDES) * (steps + WARMUP)):
            side = SIDES[ORDER[step % len(ORDER)]]
            engine = engines[side]
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            engine.backward(_loss(engine, idx, tgt, TASKS))
            engine.step()
            c1 = time.process_time()
            dist.barrier()  # a step ends when the slowest rank ends it
            if step >= len(SIDES) * WARMUP:
                wall[side].append(time.perf_counter() - t0)
                cpu[side].append(c1 - c0)
        for engine in engines.values():
            engine.destroy()
        out[stage] = (n_params, wall, cpu)
    return out


def measure(steps: int, batch_size: int, dim: int, layers: int) -> dict[int, dict[str, float]]:
    results = run_ranks(_rank, 2, steps, batch_size, dim, layers, timeout=7200)
    summary = {}
    for stage, (n_params, wall, _) in results[0].items():
        med = {s: statistics.median(wall[s]) for s in SIDES}
        cpu = {s: sum(statistics.median(results[r][stage][2][s]) for r in results) for s in SIDES}
        summary[stage] = {
            "params": n_params,
            "wall_ds": med["deepspeed"],
            "wall_dc": med["distckpt"],
            "wall_ratio": med["deepspeed"] / med["distckpt"],  # steps/s of distckpt over DeepSpeed's own
            "cpu_ds": cpu["deepspeed"],
            "cpu_dc": cpu["distckpt"],
            "cpu_ratio": cpu["deepspeed"] / cpu["distckpt"],
            "wall_st": med["static"],
            "wall_ratio_st": med["deepspeed"] / med["static"],
            "cpu_ratio_st": cpu["deepspeed"] / cpu["static"],
            "n": len(wall["distckpt"]),
        }
    return summary


def write(summary: dict[int, dict[str, float]], args: argparse.Namespace, load: str) -> Path:
    import deepspeed

    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "deepspeed.md"
    lines = [
        "# DeepSpeed ZeRO: the cost of distckpt's state",
        "",
        f"`python -m benchmarks.deepspeed --steps {args.steps} --batch-size {args.batch_size} --dim {args.dim} "
        f"--layers {args.layers}`: 2 gloo CPU ranks (`DS_ACCELERATOR=cpu`), torch {torch.__version__}, deepspeed "
        f"{deepspeed.__version__}, {platform.machine()}, a 2-core machine shared with other jobs (load average "
        f"before the run: {load}). Multi-task GPT of benchmarks.parallel, every head in the loss, every block "
        "checkpointed on both sides, torch's AdamW as the client optimizer. Steps/s ratio = median step time of "
        "DeepSpeed's own / distckpt's (> 1: distckpt faster); steps interleaved ABCCBA between three engines from the "
        'same initialisation (the third: distckpt with `graph="static"`, no join, DeepSpeed\'s own reduction); CPU = '
        "the processes' CPU time per step, summed over the ranks.",
        "",
        "| ZeRO | parameters | median step, DeepSpeed's own | median step, distckpt | steps/s distckpt / own (wall) "
        '| CPU per step, own | CPU per step, distckpt | distckpt / own (CPU) | median step, `graph="static"` '
        "| static / own (wall) | static / own (CPU) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for stage, s in summary.items():
        lines.append(
            f"| {stage} | {s['params'] / 1e6:.1f}M | {s['wall_ds'] * 1e3:.0f} ms | {s['wall_dc'] * 1e3:.0f} ms | "
            f"{s['wall_ratio']:.3f} ({s['n']} steps each) | {s['cpu_ds'] * 1e3:.0f} ms | {s['cpu_dc'] * 1e3:.0f} ms "
            f"| {s['cpu_ratio']:.3f} | {s['wall_st'] * 1e3:.0f} ms | {s['wall_ratio_st']:.3f} "
            f"| {s['cpu_ratio_st']:.3f} |"
        )
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16, help="timed steps per side (after 4 not timed)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    summary = measure(args.steps, args.batch_size, args.dim, args.layers)
    for stage, s in summary.items():
        print(f"ZeRO-{stage}", {k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()})
    print("wrote", write(summary, args, load))


if __name__ == "__main__":
    main()
