"""The tight end of the memory frontier: given exactly the memory full checkpointing needs (its measured peak),
how much does each planner recompute, and how fast does it step? ``python -m benchmarks.frontier``.

Per model (HF GPT-2, HF Llama, the built-in GPT, and HF GPT-2 at a long sequence where attention dominates), one
steady-state AdamW step per setup, each quantity in its own pass (as ``benchmarks.memory`` measures them: the CPU
allocator's peak under ``torch.profiler``, MemTracker's beside it; recompute FLOPs by ``FlopCounterMode``, CPU
attention counted), at the measured peak of distckpt's ``full``:

- ``full`` (distckpt), ``HF gc`` (Hugging Face's own gradient checkpointing, HF models);
- ``budget, per block``: ``Budget(full's peak, per_op=False)``, the planner before the per-op choice (none,
  pointwise, selective or full per block);
- ``budget``: ``Budget(full's peak)``, the per-op choice too (``"ops"``: which matmul/attention outputs a block
  keeps); its plan is the exact optimum of the profile's memory model (the Pareto program); ``budget + 1 op``
  places one more kept output (the one saving the most FLOPs per byte) in the first block that has one left and
  measures it: over the budget when the plan's limit is real;
- ``torch sac_ilp``: torch's own per-op planner (``benchmarks.sac_ilp``), its budget argument searched (its
  memory model leaves out the optimizer state) for the least recompute whose measured peak fits full's;
- ``compile F``: ``torch.compile``'s ``activation_memory_budget`` (min-cut partitioner, ``aot_eager``), the
  fractions tried, the cheapest that fits full's peak in the table.

Step time: every eager setup interleaved round by round in one run, medians of process CPU time (compiled
rows run ``aot_eager``, op by op in Python: not timed). Where full's peak sits is read off MemTracker per phase
of full's step (forward, the head, each block's backward, the embeddings' backward, the optimizer step).

Writes each model's section and plot to ``benchmarks/results/frontier/`` and ``benchmarks/results/frontier.md``
from every model's section there.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from budget_rows import call_name, mode_name, step_down
from models import GPT, SIZES, GPTConfig, batch, hf_checkpointing_enable, hf_gpt2, hf_llama
from peaks import CompiledBudget, fwd_bwd_flops, mem_tracker_peak, profiled_peak, train_step

import distckpt
from benchmarks import sac_ilp
from distckpt import _torch_compat as compat
from distckpt.select import Budget, KeepOps, Placement
from distckpt.select.budget import human_bytes, plan_budget, predicted_peak
from distckpt.select.profile import profile_model, scalar_loss

RESULTS = Path(__file__).resolve().parent / "results"
LONG = GPTConfig(vocab=1024, seq=2048, dim=256, heads=8, layers=8)
# label -> (factory, size, batch, Hugging Face, block class name)
MODELS: dict[str, tuple[Callable[[GPTConfig], nn.Module], GPTConfig, int, bool, str]] = {
    "HF GPT-2": (hf_gpt2, SIZES["medium"], 8, True, "GPT2Block"),
    "HF Llama": (hf_llama, SIZES["medium"], 8, True, "LlamaDecoderLayer"),
    "GPT": (GPT, SIZES["medium"], 8, False, "Block"),
    "HF GPT-2, seq 2048": (hf_gpt2, LONG, 1, True, "GPT2Block"),
}
COMPILE_FRACTIONS = (0.0, 0.1, 0.2)
SAC_TRIES = 8


@dataclass
class Setup:
    name: str
    build: Callable[[nn.Module], nn.Module] | None = None
    timed: bool = True
    peak: int = 0
    mem_tracker: int | None = None
    flops: int = 0
    note: str = ""
    error: str = ""
    model: nn.Module | None = None
    times: list[float] = field(default_factory=list)


@dataclass
class Run:
    label: str
    setups: list[Setup]
    phases: list[tuple[str, dict[str, int]]]
    target: int  # full's measured peak: every budget is sized at it
    tries: list[str]  # the searches of sac_ilp's budget argument and compile's fraction
    predicted: dict[str, int]  # the budget's prediction: peak and recompute FLOPs
    fwd_bwd: int  # forward+backward FLOPs without checkpointing
    optimum: list[str] = field(default_factory=list)  # the measured checks of the plan's optimality


def _blocks(model: nn.Module, cls: str) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of class ``cls`` (distckpt's checkpointed subclass of it too), in order."""
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ in (cls, f"Checkpointed{cls}")]


def measure(s: Setup, base: nn.Module, inputs: tuple, kwargs: dict, keep: bool = True) -> Setup:
    """Peak (allocator, and MemTracker on eager setups) and recompute FLOPs of one steady AdamW step, separate
    passes; the model kept for timing when ``keep``."""
    torch.manual_seed(0)
    try:
        model = s.build(copy.deepcopy(base))
    except distckpt.ConfigError as e:
        s.error = str(e)[:160]
        return s
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, opt, inputs, kwargs)  # the optimizer state exists from here: a steady step
    s.flops = fwd_bwd_flops(model, inputs, kwargs)
    s.peak = profiled_peak(model, opt, inputs, kwargs)
    if not isinstance(model, CompiledBudget):
        s.mem_tracker = mem_tracker_peak(model, opt, inputs, kwargs, torch.device("cpu"))
    s.model = model if keep and s.timed else None
    print(f"  {s.name}: {s.peak / 2**20:.2f} MiB, {s.flops / 1e9:.2f} GFLOP {s.note}", flush=True)
    return s


def full_phases(model: nn.Module, cls: str, inputs: tuple, kwargs: dict) -> list[tuple[str, dict[str, int]]]:
    """MemTracker's peak in each phase of one steady step of ``model`` (checkpointed): the forward, the head
    (after the last block's forward, before its backward), each block's backward, what runs after them, and the
    optimizer step; sorted by peak."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    train_step(model, opt, inputs, kwargs)
    blocks = _blocks(model, cls)
    phase, peaks = ["forward"], {}
    tracker = compat.mem_tracker([])
    tracker.track_external(model, opt, *inputs, *kwargs.values())

    def hooked(i: int) -> Callable[..., None]:
        def post(mod: nn.Module, args: Any, out: Any) -> None:
            if i == len(blocks) - 1:
                phase[0] = "head (logits, loss)"
            for t in compat.tree_flatten(out)[0]:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(lambda g: phase.__setitem__(0, f"block {i} backward"))

        return post

    def look() -> None:
        d = next(iter(tracker.get_tracker_snapshot().values()))
        if d["Total"] > peaks.get(phase[0], {}).get("Total", -1):
            peaks[phase[0]] = {str(k).split(".")[-1]: v for k, v in d.items()}

    class AfterOps(compat.torch_dispatch_mode()):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            look()
            return out

    hooks = [m.register_forward_hook(hooked(i)) for i, (_, m) in enumerate(blocks)]
    hooks.append(blocks[0][1].register_forward_pre_hook(lambda m, a: phase.__setitem__(0, "forward")))
    try:
        with tracker, AfterOps():
            loss = scalar_loss(model(*inputs, **kwargs))
            loss.backward()
            phase[0] = "after the blocks' backward"
            look()
            phase[0] = "optimizer step"
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        for h in hooks:
            h.remove()
    return sorted(peaks.items(), key=lambda kv: -kv[1]["Total"])


def one_more_op(plan: Any, mp: Any) -> tuple[list[Any], str] | None:
    """The plan's modes with one more kept output, the one saving the most FLOPs per byte, in the first block
    (in run order) that has one left (a full block, or an ``"ops"`` one); ``None`` when none has."""
    order = mp.run_order or range(len(mp.blocks))
    modes = [plan.mode_of(i) for i in range(len(mp.blocks))]
    for i in order:
        m, ops = modes[i], mp.blocks[i].recompute_ops
        kept = set(m.calls) if isinstance(m, KeepOps) else set() if m == "full" else None
        left = [o for o in ops if kept is not None and (o[0], o[1]) not in kept]
        if left:
            name, index, nbytes, flops = max(left, key=lambda o: o[3] / max(1, o[2]))
            modes[i] = KeepOps(tuple(sorted(kept | {(name, index)})))
            return modes, f"block {i} also keeps {call_name(name, index)} ({nbytes / 2**20:.2f} MiB)"
    return None


def measured_optimum(
    plan: Any,
    mp: Any,
    base: nn.Module,
    inputs: tuple,
    kwargs: dict,
    example: Any,
    target: int,
    full_rc: int,
    ratio: float = 0.6,
) -> list[str]:
    """Measured evidence of how close the plan is to the optimum at ``target`` (full's measured peak): each
    single-block step down in recompute from the plan (the choice of that block that recomputes less at the fewest
    bytes, ``budget_rows.step_down``) measured against ``target``, and the smallest budget at which the plan reaches
    ``ratio`` times full's recompute (a bisection over the exact program), that plan measured too."""
    modes = [plan.mode_of(i) for i in range(len(mp.blocks))]
    lines, fits = [], 0
    for i in mp.run_order or range(len(mp.blocks)):
        down = step_down(modes[i], mp.blocks[i])
        if down is None:
            lines.append(f"block {i} ({mode_name(modes[i])}): nothing recomputes less")
            continue
        mode, extra = down
        tried = [*modes[:i], mode, *modes[i + 1 :]]
        s = measure(
            Setup(f"step down {i}", lambda m, t=tried: distckpt.wrap(m, Placement(tuple(t)), example_inputs=example)),
            base,
            inputs,
            kwargs,
            keep=False,
        )
        fits += s.peak <= target
        lines.append(
            f"block {i}: {mode_name(modes[i])} -> {mode_name(mode)} (+{extra / 2**20:.2f} MiB held): measured "
            f"{(s.peak - target) / 2**20:+.2f} MiB vs full's peak ({'fits' if s.peak <= target else 'over'})"
        )
    head = f"{fits} of the plan's single-block steps down in recompute fit full's peak when measured" + (
        " (the plan is a measured local optimum)." if not fits else ": the plan is **not** the measured optimum."
    )
    goal = ratio * full_rc
    if plan.recompute_flops <= goal:
        return [head, *lines, f"The plan at full's peak recomputes <= {ratio}x full's already."]
    lo, hi = target, predicted_peak(mp, [], strategy="none")  # lo: more than 0.6x; hi: within it (none)
    while hi - lo > max(256, target // 4096):
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if plan_budget(mp, mid, strategy="none").recompute_flops <= goal else (mid, hi)
    six = plan_budget(mp, hi, strategy="none")
    placed = tuple(six.mode_of(i) for i in range(len(mp.blocks)))
    s = measure(
        Setup(f"{ratio}x", lambda m: distckpt.wrap(m, Placement(placed), example_inputs=example)),
        base,
        inputs,
        kwargs,
        keep=False,
    )
    tail = (
        f"The least budget at which the plan recomputes <= {ratio}x full's: {human_bytes(hi)} "
        f"({(hi - target) / 2**20:+.2f} MiB vs full's peak, {six.recompute_flops / full_rc:.3f}x); that plan measured: "
        f"{human_bytes(s.peak)} ({(s.peak - target) / 2**20:+.2f} MiB vs full's peak)."
    )
    return [head, *lines, tail]


def _search_sac(base: nn.Module, inputs: tuple, kwargs: dict, cls: str, target: int, tries: list[str]) -> Setup:
    """torch's plan whose measured peak fits ``target`` at the least recompute: its budget argument (GiB, for its
    own memory model, which leaves out AdamW's state) searched over :data:`SAC_TRIES` measured tries: down by the
    measured overshoot until one fits, up while its MILP finds none, then by halving the gap."""
    why = sac_ilp.available()
    if why:
        return Setup("torch sac_ilp", error=why)
    root = type(base).__name__
    names = [n for n, _ in _blocks(base, cls)]
    try:
        planner = sac_ilp.Planner(base, inputs, kwargs, root, names)
    except (AssertionError, KeyError, RuntimeError) as e:  # torch's private tools on a model they do not parse
        return Setup("torch sac_ilp", error=f"torch's planner failed on this model: {type(e).__name__} {e}"[:160])
    try:
        return _sac_tries(planner, base, inputs, kwargs, target, tries)
    finally:
        planner.close()


def _sac_tries(planner: Any, base: nn.Module, inputs: tuple, kwargs: dict, target: int, tries: list[str]) -> Setup:
    """:func:`_search_sac`'s measured tries, each budget argument planned by ``planner`` (``sac_ilp.Planner``)."""
    arg, low, high, best = target, None, None, None  # low: fits or infeasible (go up); high: over (go down)
    for _ in range(SAC_TRIES):
        p = planner.plan(arg)
        if p.predicted_peak < 0:
            tries.append(f"torch sac_ilp, budget argument {arg / 2**20:.2f} MiB: its MILP finds no plan")
            low = arg
        else:
            build = functools.partial(sac_ilp.apply, sac_plan=p)
            s = measure(Setup("torch sac_ilp", build), base, inputs, kwargs, keep=False)
            over = s.peak - target
            tries.append(
                f"torch sac_ilp, budget argument {arg / 2**20:.2f} MiB: {len(p.decisions)} blocks checkpointed, "
                f"measured {over / 2**20:+.2f} MiB vs full's peak, {s.flops / 1e9:.2f} GFLOP"
            )
            if over <= 0 and (best is None or s.flops < best[0].flops):
                best = (s, p)
            low, high = (arg, high) if over <= 0 else (low, arg)
        if high is None:
            arg = int(arg * 1.25)
        elif low is None:
            arg = int(arg - max(over, arg // 20))
        else:
            arg = (low + high) // 2
    if best is None:
        return Setup("torch sac_ilp", error="no budget argument tried fits full's peak (see the searches)")
    s, p = best
    s.build, s.note = functools.partial(sac_ilp.apply, sac_plan=p), f"{len(p.decisions)} blocks, per op"
    return measure(s, base, inputs, kwargs)


def _search_compile(base: nn.Module, inputs: tuple, kwargs: dict, target: int, tries: list[str]) -> Setup:
    """``compile F`` at each of :data:`COMPILE_FRACTIONS`: the least recompute whose measured peak fits."""
    best = None
    for f in COMPILE_FRACTIONS:
        torch._dynamo.reset()
        s = measure(Setup(f"compile {f:g}", lambda m, f=f: CompiledBudget(m, f), timed=False), base, inputs, kwargs)
        tries.append(
            f"compile {f:g}: measured {(s.peak - target) / 2**20:+.2f} MiB vs full's peak, {s.flops / 1e9:.2f} GFLOP"
        )
        if not s.error and s.peak <= target and (best is None or s.flops < best.flops):
            best = s
    return best or Setup("compile", error=f"no fraction of {COMPILE_FRACTIONS} fits full's peak (see the searches)")


def run_model(label: str, rounds: int, with_compile: bool, with_sac: bool) -> Run:
    make, cfg, bsz, hf, cls = MODELS[label]
    torch.manual_seed(0)
    base = make(cfg).train()
    idx, tgt = batch(cfg, bsz)
    inputs, kwargs = ((), {"input_ids": idx, "labels": idx}) if hf else ((idx, tgt), {})
    example = kwargs if hf else inputs
    print(f"[{label}: dim {cfg.dim}, {cfg.layers} layers, seq {cfg.seq}, batch {bsz}]", flush=True)
    none = measure(Setup("none", lambda m: m), base, inputs, kwargs)
    full = measure(Setup("full", lambda m: distckpt.wrap(m, "full")), base, inputs, kwargs)
    target, tries = full.peak, []
    phases = full_phases(distckpt.wrap(copy.deepcopy(base), "full"), cls, inputs, kwargs)
    setups = [none, full]
    if hf:
        setups.append(measure(Setup("HF gc", hf_checkpointing_enable), base, inputs, kwargs))
    block = Budget(target, per_op=False)
    setups.append(
        measure(
            Setup("budget, per block", lambda m: distckpt.wrap(m, block, example_inputs=example)), base, inputs, kwargs
        )
    )
    budget = measure(
        Setup("budget", lambda m: distckpt.wrap(m, Budget(target), example_inputs=example)), base, inputs, kwargs
    )
    setups.append(budget)
    # The plan wrap made (one process: strategy "none"), on a profile of a copy measured the same way.
    probe = copy.deepcopy(base)
    mp = profile_model(probe, _blocks(probe, cls), example)
    plan = plan_budget(mp, target, strategy="none")
    budget.note = _modes_note(plan)
    more = one_more_op(plan, mp)
    if more is not None:
        modes, what = more
        s = Setup(
            "budget + 1 op", lambda m: distckpt.wrap(m, Placement(tuple(modes)), example_inputs=example), timed=False
        )
        s.note = what
        setups.append(measure(s, base, inputs, kwargs))
    full_rc = sum(b.full_flops for b in mp.blocks)
    optimum = measured_optimum(plan, mp, base, inputs, kwargs, example, target, full_rc)
    if with_sac:
        setups.append(_search_sac(base, inputs, kwargs, cls, target, tries))
    if with_compile:
        setups.append(_search_compile(base, inputs, kwargs, target, tries))
    _time(setups, inputs, kwargs, rounds)
    predicted = {"peak": plan.peak_bytes, "recompute": plan.recompute_flops}
    return Run(label, setups, phases, target, tries, predicted, none.flops, optimum)


def _modes_note(plan: Any) -> str:
    names = list(plan.modes)
    counts = ", ".join(f"{names.count(m)} {m}" for m in dict.fromkeys(names))
    kept = sorted({c for k in plan.keep if k is not None for c in k.calls})
    return counts + (f"; kept: {', '.join(call_name(n, i) for n, i in kept)}" if kept else "")


def _time(setups: list[Setup], inputs: tuple, kwargs: dict, rounds: int) -> None:
    """Interleaved rounds: one step of every timed setup per round, process CPU time, after a warm-up step."""
    timed = [s for s in setups if s.model is not None]
    opts = {id(s): torch.optim.AdamW(s.model.parameters(), lr=1e-4) for s in timed}
    for s in timed:
        train_step(s.model, opts[id(s)], inputs, kwargs)
    for _ in range(rounds):
        for s in timed:
            t0 = time.process_time()
            train_step(s.model, opts[id(s)], inputs, kwargs)
            s.times.append(time.process_time() - t0)
    for s in setups:
        s.model = None


def _median(s: Setup) -> float:
    return statistics.median(s.times) if s.times else float("nan")


def _table(run: Run) -> list[str]:
    names = {s.name: s for s in run.setups}
    none, full = names["none"], names["full"]
    hf = names.get("HF gc")
    ref = hf if hf is not None and not hf.error else full
    full_rc = max(1, full.flops - none.flops)
    rows = [
        f"### {run.label}",
        "",
        f"Budget = full's measured peak: **{human_bytes(run.target)}** ({run.target} B). Forward+backward without "
        f"checkpointing: {run.fwd_bwd / 1e9:.2f} GFLOP.",
        "",
        "| setup | peak MiB | peak - full's | MemTracker - allocator | recompute GFLOP | recompute vs full's | "
        f"step time vs {ref.name} | vs full | plan / notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in run.setups:
        if s.error:
            rows.append(f"| {s.name} | - | - | - | - | - | - | - | {s.error} |")
            continue
        rc = s.flops - none.flops
        mt = "-" if s.mem_tracker is None else f"{s.mem_tracker - s.peak:+d} B"
        t_ref = f"{_median(s) / _median(ref):.3f}" if s.times else "-"
        t_full = f"{_median(s) / _median(full):.3f}" if s.times else "-"
        rows.append(
            f"| {s.name} | {s.peak / 2**20:.2f} | {s.peak - run.target:+d} B | {mt} | {rc / 1e9:.2f} | "
            f"{rc / full_rc:.3f} | {t_ref} | {t_full} | {s.note} |"
        )
    b = names.get("budget")
    if b is not None and not b.error:
        rows += [
            "",
            f"The budget's plan (the exact optimum of the profile's memory model): predicted peak "
            f"{human_bytes(run.predicted['peak'])}, {(run.predicted['peak'] - b.peak) / b.peak:+.2%} of its "
            f"measured {human_bytes(b.peak)}; predicted recompute {run.predicted['recompute'] / 1e9:.2f} GFLOP "
            f"({run.predicted['recompute'] / full_rc:.3f} of full's), measured {(b.flops - none.flops) / 1e9:.2f}.",
            "",
            _verdict(b, none, full, ref, run.predicted["peak"]),
        ]
    rows += ["", "Where full's peak sits (MemTracker, per phase of full's step; the largest first):", ""]
    rows += [
        "| phase | total MiB | activations | temporaries | gradients | optimizer state |",
        "|---|---|---|---|---|---|",
    ]
    for name, d in run.phases[:6]:
        mib = [f"{d.get(k, 0) / 2**20:.2f}" for k in ("Total", "ACT", "TEMP", "GRAD", "OPT")]
        rows.append(f"| {name} | {' | '.join(mib)} |")
    if run.optimum:
        head, *steps, tail = run.optimum
        rows += ["", f"How close the plan is to the measured optimum: {head}", "", *(f"- {t}" for t in steps)]
        rows += ["", tail]
    if run.tries:
        rows += ["", "Searches (each measured):", "", *(f"- {t}" for t in run.tries)]
    return [*rows, ""]


def _verdict(b: Setup, none: Setup, full: Setup, ref: Setup, predicted: int) -> str:
    """Issue 35's targets for the budget at full's peak, each said met or not from the measured figures."""

    def met(ok: bool) -> str:
        return "met" if ok else "**not met**"

    rc = (b.flops - none.flops) / max(1, full.flops - none.flops)
    off = (predicted - b.peak) / b.peak
    parts = [f"recompute <= 0.6x full's: {rc:.3f} ({met(rc <= 0.6)})"]
    if b.times:
        t_ref, t_full = _median(b) / _median(ref), _median(b) / _median(full)
        floor = b.flops / max(1, ref.flops)  # the step's time if time were FLOPs: what this recompute allows
        parts += [
            f"step time <= 0.95x {ref.name}'s: {t_ref:.3f} ({met(t_ref <= 0.95)}; its FLOPs are {floor:.3f}x "
            f"{ref.name}'s)",
            f"ahead of full: {t_full:.3f} ({met(t_full < 1)})",
        ]
    parts.append(f"predicted peak within 3% and never under the measured: {off:+.2%} ({met(0 <= off <= 0.03)})")
    return "Issue 35's targets: " + "; ".join(parts) + "."


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in label.lower()).strip("_").replace("__", "_")


def _plot(run: Run, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 4.4))
    names = {s.name: s for s in run.setups}
    none, full = names["none"], names["full"]
    full_rc = max(1, full.flops - none.flops)
    for s in run.setups:
        if s.error or s.name == "none":
            continue
        x, y = 100 * (s.flops - none.flops) / full_rc, 100 * s.peak / run.target
        color = "tab:blue" if s.name.startswith("budget") else "tab:red"
        ax.scatter([x], [y], color=color, s=30, zorder=3)
        ax.annotate(s.name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=6.5)
    ax.axhline(100, color="grey", lw=0.8, ls="--")
    ax.axvline(60, color="tab:green", lw=0.8, ls=":")
    ax.set_xlabel("recompute FLOPs (% of full's)")
    ax.set_ylabel("measured peak (% of full's)")
    ax.set_title(f"{run.label}: at full's measured peak (dashed); dotted: 60% of full's recompute", fontsize=7.5)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(run: Run, out: Path, rounds: int, started: float, command: str) -> None:
    """``run``'s section and plot into ``out/frontier/``, then ``out/frontier.md`` from every model's section
    there (in :data:`MODELS`' order): a run of some models keeps the others' last results."""
    parts = out / "frontier"
    parts.mkdir(parents=True, exist_ok=True)
    slug = _slug(run.label)
    _plot(run, parts / f"{slug}.png")
    how = (
        f"`{command}` on {platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} thread, "
        f"{rounds} interleaved timed steps per eager setup (process CPU time, median); "
        f"{time.perf_counter() - started:.0f} s into the run, load average {os.getloadavg()[0]:.1f} at its end."
    )
    table = _table(run)
    section = [table[0], "", how, "", f"![{run.label}](frontier/{slug}.png)", "", *table[2:]]
    (parts / f"{slug}.md").write_text("\n".join(section))
    lines = [
        "# The tight end of the frontier (cpu)",
        "",
        "Generated by `python -m benchmarks.frontier` (each model's section says how it ran). One steady AdamW step "
        "per setup; peak (the CPU allocator's, `torch.profiler`) and recompute FLOPs (FlopCounterMode, CPU attention "
        "counted) in separate passes. Every setup is at full checkpointing's measured peak: `peak - full's` <= 0 "
        "means it fits. `budget, per block`: the planner before the per-op choice (`Budget(size, per_op=False)`); "
        "`budget`: with it. Method: [docs/memory.md](../../docs/memory.md#the-tight-end-of-the-frontier).",
        "",
    ]
    for label in MODELS:
        f = parts / f"{_slug(label)}.md"
        if f.exists():
            lines += [f.read_text(), ""]
    (out / "frontier.md").write_text("\n".join(lines))
    print(f"wrote {parts / slug}.md, .png and {out / 'frontier.md'}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--rounds", type=int, default=9, help="interleaved timed steps per eager setup")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile's activation_memory_budget")
    ap.add_argument("--no-sac", action="store_true", help="skip torch's sac_ilp planner")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # CPU time is compute time
    started = time.perf_counter()
    command = "python -m benchmarks.frontier " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    for label in args.models:  # after each model: a partial run leaves results
        run = run_model(label, args.rounds, not args.no_compile, not args.no_sac)
        write(run, args.out, args.rounds, started, command)


if __name__ == "__main__":
    main()
