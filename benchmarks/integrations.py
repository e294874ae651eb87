"""Hugging Face Trainer with distckpt against Trainer with its own ``activation_checkpointing=True``.

Run: ``python -m benchmarks.integrations`` (Lightning's comparison: ``python -m benchmarks.integrations_lightning``;
both write their own section of ``benchmarks/results/integrations.md``).

Two gloo CPU ranks fine-tune a GPT-2 built from a config (no download; every parameter trains, one causal-LM loss:
the pattern HF's own checkpointing trains right, so both sides do the same work) with ``Trainer.train``:

- own: ``TrainingArguments(activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": False})``
  (Trainer then builds DDP with ``find_unused_parameters=False``);
- distckpt: ``DistckptCallback("full")`` + ``distckpt.integrations.hf.prepare(trainer)`` (every block checkpointed,
  non-reentrant, DDP with distckpt's flags and its zero-weight join);
- distckpt + guard: the same with ``guard_every=N`` (``--guard-every``, default 1: GradSyncGuard before every
  optimizer step; 0 leaves this side out).

Trainings alternate between the two sides (ABBA, a fresh model with the same seed each time, so load on the shared
machine hits both alike); the figures are ratios of median step times (rank 0's wall time and CPU time between
``on_step_begin`` and ``on_step_end``, the first steps of each training dropped). Peak memory per rank comes from a
separate training under MemTracker (CPU). Writes the "Hugging Face Trainer" section of
``benchmarks/results/integrations.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.ranks import run_ranks

RESULTS = Path(__file__).resolve().parent / "results"
SECTION = "## Hugging Face Trainer"
WARMUP = 2  # steps of each training not timed (allocation, DDP's first-iteration bookkeeping)
SIDES = ("own", "distckpt", "guard")


class _Data(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train(side: str, cfg: dict[str, int], batch_size: int, steps: int, guard_every: int, tracker: Any = None):
    """One ``Trainer.train`` of ``steps`` steps; the step times after the warm-up."""
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from distckpt.integrations.hf import DistckptCallback, prepare

    times: list[tuple[float, float]] = []  # per step: (wall, CPU time of this process, all its threads)

    class Clock(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            if tracker is not None:
                tracker.reset_mod_stats()  # MemTracker refuses a module's second forward otherwise; its peak is kept
            self.t0 = (time.perf_counter(), time.process_time())

        def on_step_end(self, *a: Any, **k: Any) -> None:
            times.append((time.perf_counter() - self.t0[0], time.process_time() - self.t0[1]))

    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            n_layer=cfg["layers"],
            n_embd=cfg["dim"],
            n_head=4,
            vocab_size=cfg["vocab"],
            n_positions=cfg["seq"],
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )  # fmt: skip
    )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data = _Data(steps * batch_size * world, cfg["seq"], cfg["vocab"], seed=1)
    # transformers 5.25 renamed gradient_checkpointing* to activation_checkpointing* (the old names warn; gone in v6).
    name = (
        "activation_checkpointing"
        if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
        else "gradient_checkpointing"
    )
    own = {name: True, f"{name}_kwargs": {"use_reentrant": False}}
    callbacks: list[Any] = [Clock()]
    if side != "own":
        callbacks.append(DistckptCallback("full", guard_every=guard_every if side == "guard" else 0))
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, use_cpu=True, per_device_train_batch_size=batch_size, max_steps=steps, optim="adamw_torch",
            learning_rate=1e-4, save_strategy="no", report_to="none", disable_tqdm=True, logging_strategy="no",
            dataloader_num_workers=0, **(own if side == "own" else {}),
        )  # fmt: skip
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
        if side != "own":
            prepare(trainer)
        try:
            if tracker is None:
                trainer.train()
            else:
                tracker.track_external(model)
                with tracker:
                    trainer.train()
        finally:
            os.environ.clear()
            os.environ.update(env)
            for state in (AcceleratorState, GradientState, PartialState):  # a fresh Accelerator next time
                state._reset_state()
    return times[WARMUP:]


def _rank(rank: int, world: int, rounds: int, steps: int, batch_size: int, cfg: dict[str, int], guard: int) -> Any:
    from distckpt import _torch_compat as compat

    sides = SIDES if guard else SIDES[:2]
    times: dict[str, list[tuple[float, float]]] = {s: [] for s in sides}
    for r in range(rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:  # ABBA (ABCCBA)
            times[side] += _train(side, cfg, batch_size, steps, guard)
    peaks = {}
    for side in sides:
        tracker = compat.mem_tracker([])
        _train(side, cfg, batch_size, WARMUP + 1, guard, tracker)
        peaks[side] = max(d.get("Total", 0) for d in tracker.get_tracker_snapshot("peak").values())
    return times, peaks


def measure(rounds: int, steps: int, batch_size: int, cfg: dict[str, int], guard_every: int) -> dict[str, Any]:
    """Run the two ranks: per side, the median step time, its steps/s over HF's own, and the peak (max over ranks)."""
    results = run_ranks(_rank, 2, rounds, steps, batch_size, cfg, guard_every, timeout=7200)
    times = results[0][0]
    wall = {s: statistics.median(w for w, _ in t) for s, t in times.items()}
    cpu = {s: statistics.median(c for _, c in t) for s, t in times.items()}
    return {
        s: {
            "step_s": wall[s],
            "ratio": wall["own"] / wall[s],  # steps/s of this side over steps/s of HF's own
            "cpu_s": cpu[s],
            "cpu_ratio": cpu["own"] / cpu[s],  # the same in CPU time: what other jobs' load does not stretch
            "n": len(times[s]),
            "peak": max(results[r][1][s] for r in results),
        }
        for s in times
    }


def write(s: dict[str, dict[str, Any]], args: argparse.Namespace, load: str) -> Path:
    """Replace (or add, before the Lightning section) this benchmark's section of results/integrations.md."""
    import transformers

    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "integrations.md"
    text = path.read_text() if path.exists() else "# Integrations: overhead\n\n"
    lines = [
        SECTION,
        "",
        f"`python -m benchmarks.integrations --rounds {args.rounds} --steps {args.steps} "
        f"--batch-size {args.batch_size} --dim {args.dim} --layers {args.layers} --seq {args.seq} "
        f"--guard-every {args.guard_every}`: 2 gloo CPU ranks, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, {platform.machine()}, a 2-core "
        f"machine shared with other jobs (`uptime` before the run: load average {load}). GPT-2 from a config, every "
        "parameter trained (AdamW), one causal-LM loss, every block checkpointed on both sides, non-reentrant. "
        "Steps/s ratio = median step time of HF's own / this side's (> 1: faster than HF's own), rank 0, interleaved "
        "trainings (ABC, then CBA); CPU = the process's CPU time per step (all its threads), which other jobs' load "
        "stretches less than wall time; peak = MemTracker, max over ranks, a separate training.",
        "",
        "| side | median step (wall) | steps/s over HF's own (wall) | median step (CPU) | over HF's own (CPU) "
        "| peak (MiB) | peak - HF's own |",
        "|---|---|---|---|---|---|---|",
    ]
    label = {
        "own": '`activation_checkpointing=True`, `activation_checkpointing_kwargs={"use_reentrant": False}` '
        "(HF's own; Trainer's DDP: `find_unused_parameters=False`)",
        "distckpt": '`DistckptCallback("full")` + `prepare(trainer)`',
        "guard": f'`DistckptCallback("full", guard_every={args.guard_every})` + `prepare(trainer)`',
    }
    own_peak = s["own"]["peak"]
    for side, r in s.items():
        lines.append(
            f"| {label[side]} | {r['step_s'] * 1e3:.0f} ms | {r['ratio']:.3f} ({r['n']} steps) "
            f"| {r['cpu_s'] * 1e3:.0f} ms | {r['cpu_ratio']:.3f} | {r['peak'] / 2**20:.2f} "
            f"| {r['peak'] - own_peak:+,} B |"
        )
    lines.append("")
    section = "\n".join(lines)
    if SECTION in text:
        before, rest = text.split(SECTION, 1)
        after = rest.split("\n## ", 1)
        text = before + section + ("\n## " + after[1] if len(after) > 1 else "")
    elif "## Lightning" in text:
        before, after = text.split("## Lightning", 1)
        text = before + section + "\n## Lightning" + after
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="trainings per side (ABBA order)")
    parser.add_argument("--steps", type=int, default=8, help="steps per training (the first 2 are not timed)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--guard-every", type=int, default=1, help="the guarded side's GradSyncGuard (0: no such side)")
    args = parser.parse_args()
    load = os.getloadavg()
    cfg = {"dim": args.dim, "layers": args.layers, "seq": args.seq, "vocab": 2048}
    summary = measure(args.rounds, args.steps, args.batch_size, cfg, args.guard_every)
    for side, r in summary.items():
        print(side, {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()})
    print("wrote", write(summary, args, ", ".join(f"{x:.2f}" for x in load)))


if __name__ == "__main__":
    main()
