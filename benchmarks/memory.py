"""Memory vs recompute of distckpt's policies and its budget frontier next to PyTorch's
checkpoint_wrapper, Hugging Face's gradient checkpointing and torch.compile's activation memory
budget, on GPT-style models: ``python -m benchmarks.memory [--device cuda]``.

For each configuration, one AdamW training step (forward, backward, ``optimizer.step``) is measured
in steady state (the optimizer state exists), each quantity in its own pass:

- peak memory: on CPU the bytes live at the step's start (parameters, buffers, optimizer state,
  batch) plus the highest running sum of the CPU allocator's events recorded by
  ``torch.profiler.profile(profile_memory=True)``, for every row; MemTracker is run as well on the
  eager rows and the table shows the difference (MemTracker cannot measure a compiled step: under
  its dispatch mode the compiled module runs its eager code). On CUDA ``max_memory_allocated``.
- recompute FLOPs: ``FlopCounterMode`` of forward+backward minus that of the run without
  checkpointing; for torch.compile rows a ``FlopCounterMode`` entered inside the compiled forward
  and backward graphs (around the call it would see the eager code, as MemTracker does). Every
  counter is ``distckpt.select.profile.flop_counter()``, which adds FLOP formulas for the CPU attention
  kernel (torch 2.13 has none); the compiled graphs keep that kernel too, so both count attention.
- step time as a ratio to no checkpointing (all configurations interleaved round by round, medians).

Writes ``benchmarks/results/memory_<device>.md`` and ``memory_<device>.png``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import platform
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from frontier import TOLERANCE, Config, budget_configs, dominance
from models import GPT, SIZES, Block, GPTConfig, batch, hf_checkpointing_enable, hf_gpt2
from peaks import CompiledBudget, fwd_bwd_flops, mem_tracker_peak, profiled_peak, train_step

import distckpt
from distckpt import ConfigError
from distckpt.apply.wrap import is_checkpointed

RESULTS = Path(__file__).resolve().parent / "results"
COMPILE_FRACTIONS = (0.1, 0.3, 0.5, 1.0)
BUDGET_POINTS = 8


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(model: nn.Module, opt: torch.optim.Optimizer, inputs: tuple, kwargs: dict, device: torch.device) -> int:
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        train_step(model, opt, inputs, kwargs)
        _sync(device)
        return torch.cuda.max_memory_allocated(device)
    return profiled_peak(model, opt, inputs, kwargs)


def _torch_ac(model: nn.Module, block_cls: type, every: int = 1) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    blocks = [m for m in model.modules() if isinstance(m, block_cls)]
    chosen = {id(m) for m in blocks[::every]}
    apply_activation_checkpointing(
        model,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: id(m) in chosen,
    )
    return model


def _hf_gc(model: nn.Module) -> nn.Module:
    return hf_checkpointing_enable(model, use_reentrant=False)


def _configs(block_cls: type, hf: bool, cuda: bool, fractions: tuple[float, ...]) -> list[Config]:
    configs = [
        Config("none", lambda m: m),
        Config("full", lambda m: distckpt.wrap(m, "full"), peer="torch full"),
        Config("every:2", lambda m: distckpt.wrap(m, "every:2"), peer="torch every:2"),
        Config("selective", lambda m: distckpt.wrap(m, "selective")),
        Config("pointwise", lambda m: distckpt.wrap(m, distckpt.Selective(every_other_matmul=False))),
        Config("torch full", lambda m: _torch_ac(m, block_cls), kind="peer"),
        Config("torch every:2", lambda m: _torch_ac(m, block_cls, 2), kind="peer"),
    ]
    if cuda:  # on a CPU-only machine offload copies nothing (tensors are already on the CPU)
        configs.insert(4, Config("full+offload", lambda m: distckpt.wrap(m, "full", offload="cpu")))
    if hf:
        configs.append(Config("HF gc", _hf_gc, kind="peer"))
    configs += [Config(f"compile {f:g}", lambda m, f=f: CompiledBudget(m, f), kind="compile") for f in fractions]
    return configs


def _smallest_budget(base: nn.Module, example: Any) -> int | None:
    """The smallest size ``budget:SIZE`` accepts, as its ``ConfigError`` names it."""
    try:
        distckpt.wrap(copy.deepcopy(base), "budget:1", example_inputs=example)
    except ConfigError as e:
        m = re.search(r"budget:(\d+) or more", str(e))
        return int(m.group(1)) if m else None
    return 1


def run_model(
    label: str,
    base: nn.Module,
    block_cls: type,
    inputs: tuple,
    kwargs: dict,
    device: torch.device,
    rounds: int,
    hf: bool,
    fractions: tuple[float, ...],
    points: int,
) -> list[Config]:
    """Measure every configuration on one model; returns them with their figures filled in."""
    torch._dynamo.reset()  # the compiled rows of the previous model hold cache entries on the same code
    base = base.to(device).train()
    example = kwargs if kwargs else inputs
    configs = _configs(block_cls, hf, device.type == "cuda", fractions)
    t0 = time.perf_counter()
    for cfg in configs:
        _prepare(cfg, base, inputs, kwargs, device, block_cls)
        print(
            f"  {cfg.name}: {cfg.error or f'{cfg.peak / 2**20:.2f} MiB'} ({time.perf_counter() - t0:.0f} s)", flush=True
        )
    none = configs[0]
    smallest = _smallest_budget(base, example)
    budgets = budget_configs(smallest, none.peak, example, points, configs[1:]) if smallest else []
    for cfg in budgets:
        _prepare(cfg, base, inputs, kwargs, device, block_cls)
        print(f"  {cfg.name}: {cfg.error or f'{cfg.peak / 2**20:.2f} MiB'}", flush=True)
    all_configs = configs + budgets
    ok = [c for c in all_configs if not c.error]
    base_flops = none.flops
    for c in ok:
        c.flops -= base_flops
    # Interleaved timing: one step of each configuration per round, so drift hits all alike.
    opts = {c.name: torch.optim.AdamW(c.model.parameters(), lr=1e-4) for c in ok}
    for c in ok:  # warm-up
        train_step(c.model, opts[c.name], inputs, kwargs)
    # On CPU the process's CPU time, not wall time: a shared machine's other load does not count.
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    for _ in range(rounds):
        for c in ok:
            _sync(device)
            t0 = clock()
            train_step(c.model, opts[c.name], inputs, kwargs)
            _sync(device)
            c.times.append(clock() - t0)
    for c in all_configs:
        c.model = None
    print(f"[{label}] done", flush=True)
    return all_configs


def _prepare(cfg: Config, base: nn.Module, inputs: tuple, kwargs: dict, device: torch.device, block_cls: type) -> None:
    torch.manual_seed(0)
    try:
        model = cfg.build(copy.deepcopy(base))
    except ConfigError as e:
        cfg.error = str(e).split(";")[0].split(":")[0]
        return
    n = sum(1 for m in model.modules() if isinstance(m, block_cls) and is_checkpointed(m))
    n += sum(1 for m in model.modules() if type(m).__name__ == "CheckpointWrapper")
    if cfg.name == "HF gc":
        n = sum(1 for m in model.modules() if isinstance(m, block_cls))
    cfg.checkpointed = str(n)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, opt, inputs, kwargs)  # compiles; creates the optimizer state: measure the steady state
    cfg.flops = fwd_bwd_flops(model, inputs, kwargs)
    if isinstance(model, CompiledBudget):
        cfg.checkpointed = f"{model.graph_flops.graphs} graph runs"
        if not model.graph_flops.graphs:
            cfg.error = "no compiled graph ran (dynamo fell back to eager)"
            return
    cfg.peak = _peak(model, opt, inputs, kwargs, device)
    if device.type == "cpu" and cfg.kind != "compile":
        cfg.mem_tracker = mem_tracker_peak(model, opt, inputs, kwargs, device)
    cfg.model = model


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _ratio(c: Config, none: Config) -> float:
    return statistics.median(c.times) / statistics.median(none.times)


def _table(label: str, configs: list[Config], fwd_bwd_flops: int) -> list[str]:
    none = next(c for c in configs if c.name == "none")
    names = {c.name: c for c in configs}
    rows = [
        f"### {label}",
        "",
        "| configuration | blocks checkpointed | peak MiB | peak vs none | MemTracker - profiler | "
        "recompute GFLOP (% of fwd+bwd) | step time vs none (median) | notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in configs:
        if c.error:
            rows.append(f"| {c.name} | - | - | - | - | - | - | {c.error} |")
            continue
        notes = []
        if c.budget is not None:
            over = "" if c.mem_tracker is None else f", MemTracker {c.mem_tracker - c.budget:+d} B"
            notes.append("within" if c.peak <= c.budget else f"EXCEEDED by {c.peak - c.budget} B{over}")
            if c.at:
                notes.append(f"sized at the peak of {c.at}")
        if c.peer and c.peer in names and not names[c.peer].error:
            p = names[c.peer]
            notes.append(f"vs {c.peer}: peak {c.peak - p.peak:+d} B, time x{_ratio(c, none) / _ratio(p, none):.3f}")
        mt = "-" if c.mem_tracker is None else f"{c.mem_tracker - c.peak:+d} B"
        rows.append(
            f"| {c.name} | {c.checkpointed} | {_mib(c.peak)} | {c.peak / none.peak:.1%} | {mt} | "
            f"{c.flops / 1e9:.3f} ({c.flops / max(fwd_bwd_flops, 1):.1%}) | {_ratio(c, none):.3f} | "
            f"{'; '.join(notes)} |"
        )
    return [*rows, ""]


def _plot(results: dict[str, list[Config]], flops_ref: dict[str, int], path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4.8), squeeze=False)
    style = {"distckpt": ("o", "tab:blue"), "peer": ("s", "tab:red"), "compile": ("^", "tab:green")}
    for ax, (label, configs) in zip(axes[0], results.items()):
        none = next(c for c in configs if c.name == "none")
        ref = flops_ref[label]
        ok = [c for c in configs if not c.error]

        def xy(c: Config, ref: int = ref, none: Config = none) -> tuple[float, float]:
            return 100 * c.flops / ref, 100 * c.peak / none.peak

        frontier = sorted((c for c in ok if c.kind == "budget"), key=lambda c: (c.flops, c.peak))
        if frontier:
            ax.plot(
                *zip(*map(xy, frontier)), "-", color="tab:blue", alpha=0.5, marker=".", label="distckpt budget:SIZE"
            )
        # Configurations with the same placement sit on the same point: one marker, one joined label.
        points: dict[tuple[float, float], list[Config]] = {}
        for c in ok:
            if c.kind != "budget":
                x, y = xy(c)
                points.setdefault((round(x, 2), round(y, 2)), []).append(c)
        for k, ((x, y), same) in enumerate(sorted(points.items())):
            marker, color = style[same[0].kind]
            ax.scatter([x], [y], marker=marker, s=36, color=color, zorder=3)
            ax.annotate(
                " = ".join(c.name for c in same),
                (x, y),
                textcoords="offset points",
                xytext=(5, 7 * (k % 2) - 7),
                fontsize=6.5,
            )
        ax.margins(x=0.2)
        ax.set_xlabel("recompute FLOPs (% of forward+backward)")
        ax.set_ylabel("peak training memory (% of no checkpointing)")
        ax.set_title(label, fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.suptitle(
        f"distckpt (circles; line: budget:SIZE), PyTorch / HF (squares), torch.compile "
        f"activation_memory_budget (triangles), {device}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _planner_seconds(n: int = 100) -> float:
    import random

    from distckpt.select.budget import plan_budget, predicted_peak
    from distckpt.select.profile import BlockProfile, ModelProfile

    rng = random.Random(0)
    blocks = []
    for i in range(n):
        inp = rng.randint(1, 50) * 2**20
        blocks.append(
            BlockProfile(
                f"b{i}",
                inp + rng.randint(0, 400) * 2**20,
                rng.randint(1, 1000) * 10**9,
                inp,
                inp,
                rng.randint(0, 100) * 2**20,
            )
        )
    mp = ModelProfile(tuple(blocks), param_bytes=2**30, trainable_bytes=2**30)
    budget = (predicted_peak(mp, range(n)) + predicted_peak(mp, [])) // 2
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        plan_budget(mp, budget)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", nargs="+", default=None, help=f"GPT sizes from {sorted(SIZES)}")
    ap.add_argument("--hf-size", default=None, help="size of the Hugging Face GPT-2 (config only, random weights)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None, help="timed steps per configuration")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (1: CPU time equals compute time)")
    ap.add_argument("--budget-points", type=int, default=BUDGET_POINTS, help="budget sizes per model (>= 2)")
    ap.add_argument(
        "--compile-fractions",
        type=float,
        nargs="*",
        default=list(COMPILE_FRACTIONS),
        help="torch.compile activation_memory_budget values (none: skip torch.compile)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    # On CPU one GPT size and HF's GPT-2: with torch.compile rows and a budget sweep the run takes about
    # 10 minutes on 2 shared cores (--sizes small medium for more).
    sizes = args.sizes or (["medium", "large"] if cuda else ["small"])
    hf_size = args.hf_size or ("medium" if cuda else "small")
    bsz = args.batch or (8 if cuda else 2)
    rounds = args.rounds or (20 if cuda else 5)
    fractions = tuple(args.compile_fractions)
    if not cuda:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()

    results: dict[str, list[Config]] = {}
    flops_ref: dict[str, int] = {}
    models: list[tuple[str, Callable[[], nn.Module], type, GPTConfig, bool]] = [
        (f"GPT {s}", functools.partial(GPT, SIZES[s]), Block, SIZES[s], False) for s in sizes
    ]
    try:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        models.append(
            (f"HF GPT-2 ({hf_size})", functools.partial(hf_gpt2, SIZES[hf_size]), GPT2Block, SIZES[hf_size], True)
        )
    except ImportError:
        print("transformers is not installed: skipping the Hugging Face GPT-2 model")
    for name, make, block_cls, cfg, hf in models:
        torch.manual_seed(0)
        model = make()
        idx, tgt = batch(cfg, bsz, device=device)
        inputs, kwargs = ((), {"input_ids": idx, "labels": idx}) if hf else ((idx, tgt), {})
        label = f"{name}: dim {cfg.dim}, {cfg.layers} layers, seq {cfg.seq}, vocab {cfg.vocab}, batch {bsz}"
        print(f"[{label}]", flush=True)
        configs = run_model(label, model, block_cls, inputs, kwargs, device, rounds, hf, fractions, args.budget_points)
        results[label] = configs
        flops_ref[label] = fwd_bwd_flops(model.to(device), inputs, kwargs)
        _write(args, device, rounds, started, results, flops_ref)  # after each model: a partial run leaves results


def _write(
    args: argparse.Namespace,
    device: torch.device,
    rounds: int,
    started: float,
    results: dict[str, list[Config]],
    flops_ref: dict[str, int],
) -> None:
    cuda = device.type == "cuda"
    args.out.mkdir(parents=True, exist_ok=True)
    tag = device.type
    md = args.out / f"memory_{tag}.md"
    png = args.out / f"memory_{tag}.png"
    peak_how = (
        "torch.cuda.max_memory_allocated"
        if cuda
        else "the bytes live at the step's start (parameters, buffers, AdamW state, batch) plus the highest "
        "running sum of the CPU allocator's events under `torch.profiler.profile(profile_memory=True)`, "
        "for every row (MemTracker cannot see a compiled step: under its dispatch mode the compiled "
        "module runs its eager code; on the eager rows the column MemTracker - profiler checks the "
        "two agree: the profiler also sees the 5056-byte CPU RNG state that checkpointing saves per "
        "checkpointed block, and on HF GPT-2 the three Python numbers (8 bytes each) that autograd "
        "saves per block for `NewGELUActivation`'s `0.5 * x`: MemTracker sees neither)"
    )
    lines = [
        f"# Memory vs recompute ({tag})",
        "",
        f"Generated by `python -m benchmarks.memory --device {tag}` on {platform.machine()} "
        f"({torch.cuda.get_device_name(device) if cuda else platform.processor() or 'CPU'}), torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, {rounds} interleaved timed steps per "
        f"configuration ({'wall time' if cuda else 'process CPU time'}, median), "
        f"{time.perf_counter() - started:.0f} s in all. One AdamW step (forward, backward, optimizer.step) "
        f"in steady state, each quantity in its own pass. Peak memory: {peak_how}. Recompute FLOPs: "
        "FlopCounterMode of forward+backward minus the run without checkpointing; for `compile F` rows a "
        "FlopCounterMode entered inside the compiled forward and backward graphs (around the compiled call "
        "it counts the eager code, as MemTracker does). Attention's FLOPs are counted on CPU too "
        "(`distckpt.select.profile.flop_counter`: torch's CUDA formulas for the CPU kernel, which the compiled "
        "graphs keep as well).",
        "",
        f'`budget X MiB`: `wrap(model, "budget:SIZE")` at {args.budget_points} sizes from the smallest it '
        "accepts (the size its ConfigError names) to the peak without checkpointing, and at the measured peak "
        "of every other row it accepts (`sized at the peak of`: given the same memory, does the budget need no "
        "more recompute?); `within` means the measured peak is at most SIZE. `pointwise`: every block "
        "checkpointed keeping every matmul/attention output (`Selective(every_other_matmul=False)`, the "
        "budget's fourth per-block mode): only ops that count no FLOPs are recomputed. `compile F`: "
        "`torch.compile` with "
        "`torch._functorch.config.activation_memory_budget = F` and the backend "
        "`aot_eager_decomp_partition_with_mode` (the decompositions and min-cut partitioner of "
        "`aot_eager_decomp_partition`, the graphs run under a FlopCounterMode switch; checked by hand once, "
        "GPT small at F = 0.3: the same peak as `aot_eager_decomp_partition`). `graph runs`: the compiled "
        "forward and backward graphs one step runs (a forward and a backward per dynamo graph). Its step "
        "time is the aot_eager backend's (FX graphs run op by op in Python, no fusion): compare its memory "
        "and FLOPs with the eager rows, not its time.",
        "",
        f"Dominance: a peer point counts as dominated or equalled when a budget point is at most "
        f"{TOLERANCE:.1%} of the no-checkpointing peak above it in memory and at most {TOLERANCE:.1%} of "
        "forward+backward FLOPs above it in recompute, both computed from the figures below. A **no** names "
        "the budget point sized at that point's measured peak: given the same memory, the plan needed more "
        "recompute. The reason seen (CPU attention FLOPs counted, blocks keeping only what their recompute "
        "reads): the plan predicts a placement above its measured peak, so a budget sized exactly at that peak "
        "does not take it (a plan never exceeds its budget by its own prediction). All-`selective` and "
        "all-`pointwise` on HF GPT-2 were 7168 B above (the `cache_position` every block takes, counted once "
        "per block): counted once since (BlockProfile.shared_input_bytes), exact.",
        "",
        f"![memory vs recompute]({png.name})",
        "",
    ]
    for label, configs in results.items():
        lines += _table(label, configs, flops_ref[label])
        lines += dominance(label, configs, flops_ref[label])
    lines += [f"Planner: {_planner_seconds():.3f} s to place 100 blocks of random profiles (median of 5).", ""]
    md.write_text("\n".join(lines))
    _plot(results, flops_ref, png, tag)
    print(f"wrote {md} and {png}", flush=True)


if __name__ == "__main__":
    main()
