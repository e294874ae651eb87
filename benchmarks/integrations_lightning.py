"""Lightning with distckpt against Lightning's own activation checkpointing.

Run: ``python -m benchmarks.integrations_lightning``.

Two gloo CPU ranks train the multi-task GPT of ``benchmarks.parallel`` (every head in the loss: the one pattern
Lightning's own way trains right, so both sides do the same work) inside ``Trainer.fit``:

- DDP: ``DDPStrategy()`` with PyTorch's ``checkpoint_wrapper`` (non-reentrant) on every block, as Lightning's docs
  do it in ``configure_model``, against ``DistckptDDPStrategy("full")``;
- FSDP: ``FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block})`` against
  ``DistckptFSDPStrategy("full")``.

Fits alternate between the two sides (ABBA, a fresh model with the same seed each time, so load on the shared
machine hits both alike); the figure is the ratio of median step times (rank 0's wall time between
``on_train_batch_start`` and ``on_train_batch_end``, first steps of each fit dropped). Peak memory per rank comes
from a separate fit under MemTracker (CPU). Writes ``benchmarks/results/integrations.md`` (its Lightning section).
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
from lightning_cpu import cpu_fsdp_strategy

from benchmarks.ranks import run_ranks

RESULTS = Path(__file__).resolve().parent / "results"
WARMUP = 2  # steps of each fit not timed (allocation, DDP's first-iteration bookkeeping)


def _module(cfg: Any, batch_size: int, rank: int) -> Any:
    import lightning.pytorch as pl
    from models import batch

    from benchmarks.parallel import TASKS, MultiTaskGPT, _loss

    class GPTModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = MultiTaskGPT(cfg)

        def training_step(self, b: Any, i: int) -> torch.Tensor:
            return _loss(self.net, b[0], b[1], TASKS)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4, weight_decay=0.1)

    idx, tgt = batch(cfg, batch_size, seed=rank)
    return GPTModule(), [(idx, tgt)]


def _strategy(side: str, lm: Any) -> Any:
    from lightning.pytorch.strategies import DDPStrategy
    from models import Block
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from distckpt.integrations.lightning import DistckptDDPStrategy, DistckptFSDPStrategy

    if side == "ddp/own":
        apply_activation_checkpointing(lm.net, check_fn=lambda m: isinstance(m, Block))  # non-reentrant default
        return DDPStrategy()
    if side == "fsdp/own":
        return cpu_fsdp_strategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block})
    return {"ddp/distckpt": DistckptDDPStrategy, "fsdp/distckpt": DistckptFSDPStrategy}[side]("full", blocks="net.h.*")


def _fit(side: str, cfg: Any, batch_size: int, rank: int, steps: int, tracker: Any = None) -> list[float]:
    """One fit of ``steps`` steps; the step times after the warm-up."""
    import lightning.pytorch as pl

    times: list[float] = []

    class Clock(pl.Callback):
        def on_train_batch_start(self, *a: Any) -> None:
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, *a: Any) -> None:
            times.append(time.perf_counter() - self.t0)

    class Reset(pl.Callback):
        def on_train_batch_start(self, *a: Any) -> None:
            tracker.reset_mod_stats()  # MemTracker refuses a module's second forward otherwise; its peak is kept

    lm, data = _module(cfg, batch_size, rank)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=_strategy(side, lm),
        max_steps=steps,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Clock()] if tracker is None else [Clock(), Reset()],
    )
    env = dict(os.environ)
    loader = torch.utils.data.DataLoader(data * steps, batch_size=None)
    try:
        if tracker is None:
            trainer.fit(lm, loader)
        else:
            tracker.track_external(lm)
            with tracker:
                trainer.fit(lm, loader)
    finally:
        os.environ.clear()
        os.environ.update(env)  # Lightning's teardown deletes WORLD_SIZE
    return times[WARMUP:]


def _rank(rank: int, world: int, rounds: int, steps: int, batch_size: int, dim: int, layers: int) -> Any:
    from models import GPTConfig

    from distckpt import _torch_compat as compat

    cfg = GPTConfig(vocab=2048, seq=128, dim=dim, heads=4, layers=layers)
    out: dict[str, Any] = {}
    for strategy in ("ddp", "fsdp"):
        sides = (f"{strategy}/own", f"{strategy}/distckpt")
        times: dict[str, list[float]] = {s: [] for s in sides}
        for r in range(rounds):
            for side in sides if r % 2 == 0 else sides[::-1]:  # ABBA
                times[side] += _fit(side, cfg, batch_size, rank, steps)
        peaks = {}
        for side in sides:
            tracker = compat.mem_tracker([])
            _fit(side, cfg, batch_size, rank, WARMUP + 1, tracker)
            peaks[side] = max(d.get("Total", 0) for d in tracker.get_tracker_snapshot("peak").values())
        out[strategy] = (times, peaks)
    return out


def measure(rounds: int, steps: int, batch_size: int, dim: int, layers: int) -> dict[str, dict[str, float]]:
    """Run the two ranks; per strategy: median step times, their ratio, and the peaks of both ranks."""
    results = run_ranks(_rank, 2, rounds, steps, batch_size, dim, layers, timeout=7200)
    summary = {}
    for strategy, (times, _) in results[0].items():
        own, ours = (statistics.median(times[f"{strategy}/{s}"]) for s in ("own", "distckpt"))
        peaks = {s: max(results[r][strategy][1][f"{strategy}/{s}"] for r in results) for s in ("own", "distckpt")}
        summary[strategy] = {
            "own_s": own,
            "distckpt_s": ours,
            "ratio": own / ours,  # steps/s of distckpt over steps/s of Lightning's own
            "n": len(times[f"{strategy}/own"]),
            "own_peak": peaks["own"],
            "distckpt_peak": peaks["distckpt"],
        }
    return summary


def write(summary: dict[str, dict[str, float]], args: argparse.Namespace) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "integrations.md"
    head = path.read_text().split("## Lightning")[0] if path.exists() else "# Integrations: overhead\n\n"
    lines = [
        "## Lightning",
        "",
        f"`python -m benchmarks.integrations_lightning --rounds {args.rounds} --steps {args.steps} --batch-size "
        f"{args.batch_size} --dim {args.dim} --layers {args.layers}`: 2 gloo CPU ranks, torch {torch.__version__}, "
        f"lightning {_lightning_version()}, {platform.machine()}, a 2-core machine shared with other jobs (loaded: "
        "ratios within +-10% are noise here). Multi-task GPT of benchmarks.parallel, every head in the loss, every "
        "block checkpointed on both sides. Steps/s ratio = median step time of Lightning's own / distckpt's "
        "(> 1: distckpt faster), interleaved fits (ABBA); peak = MemTracker, max over ranks, a separate fit.",
        "",
        "| strategy | Lightning's own checkpointing | median step, own | median step, distckpt "
        "| steps/s distckpt / own | peak own | peak distckpt |",
        "|---|---|---|---|---|---|---|",
    ]
    own_kind = {
        "ddp": "`DDPStrategy()` + `checkpoint_wrapper` per block",
        "fsdp": "`FSDPStrategy(activation_checkpointing_policy={Block})`",
    }
    for strategy, s in summary.items():
        lines.append(
            f"| {strategy} | {own_kind[strategy]} | {s['own_s'] * 1e3:.0f} ms | {s['distckpt_s'] * 1e3:.0f} ms | "
            f"{s['ratio']:.3f} ({s['n']} steps each) | {s['own_peak'] / 2**20:.1f} MiB | "
            f"{s['distckpt_peak'] / 2**20:.1f} MiB |"
        )
    path.write_text(head + "\n".join(lines) + "\n")
    return path


def _lightning_version() -> str:
    import lightning

    return lightning.__version__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="fits per side (ABBA order)")
    parser.add_argument("--steps", type=int, default=8, help="steps per fit (the first 2 are not timed)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()
    summary = measure(args.rounds, args.steps, args.batch_size, args.dim, args.layers)
    for strategy, s in summary.items():
        print(strategy, {k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()})
    print("wrote", write(summary, args))


if __name__ == "__main__":
    main()
