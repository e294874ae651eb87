"""Memory vs time of distckpt's policies next to PyTorch's checkpoint_wrapper and Hugging Face's
gradient checkpointing, on GPT-style models: ``python -m benchmarks.memory [--device cuda]``.

For each configuration, one AdamW training step (forward, backward, ``optimizer.step``) is measured:
peak memory (MemTracker on CPU, ``torch.cuda.max_memory_allocated`` on CUDA, steady state: the
optimizer state exists), recompute FLOPs (``FlopCounterMode`` of forward+backward minus that of the
run without checkpointing) and step time as a ratio to no checkpointing (steps of all
configurations interleaved round by round, medians). Writes ``benchmarks/results/memory_<device>.md``
and ``memory_<device>.png``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

import distckpt
from benchmarks.models import GPT, SIZES, Block, GPTConfig, batch, hf_gpt2
from distckpt import Budget, ConfigError
from distckpt.apply.wrap import is_checkpointed
from distckpt.select.budget import static_bytes
from distckpt.select.profile import profile_model, scalar_loss

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Config:
    name: str
    build: Callable[[nn.Module], nn.Module]  # applies checkpointing to a fresh copy of the model
    peer: str = ""  # the config it is compared with at the same placement
    budget: int | None = None
    error: str = ""
    model: nn.Module | None = None
    peak: int = 0
    flops: int = 0
    times: list[float] = field(default_factory=list)
    checkpointed: int = 0


def _step(model: nn.Module, opt: torch.optim.Optimizer, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    scalar_loss(model(*inputs, **kwargs)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(model: nn.Module, opt: torch.optim.Optimizer, inputs: tuple, kwargs: dict, device: torch.device) -> int:
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        _step(model, opt, inputs, kwargs)
        _sync(device)
        return torch.cuda.max_memory_allocated(device)
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(model, opt, *inputs, *kwargs.values())
    with mt:
        _step(model, opt, inputs, kwargs)
    return mt.get_tracker_snapshot("peak")[device]["Total"]


def _fwd_bwd_flops(model: nn.Module, inputs: tuple, kwargs: dict) -> int:
    with FlopCounterMode(display=False) as counter:
        scalar_loss(model(*inputs, **kwargs)).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


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
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _configs(block_cls: type, hf: bool) -> list[Config]:
    configs = [
        Config("none", lambda m: m),
        Config("full", lambda m: distckpt.wrap(m, "full"), peer="torch full"),
        Config("every:2", lambda m: distckpt.wrap(m, "every:2"), peer="torch every:2"),
        Config("selective", lambda m: distckpt.wrap(m, "selective")),
        Config("full+offload", lambda m: distckpt.wrap(m, "full", offload="cpu")),
        Config("torch full", lambda m: _torch_ac(m, block_cls)),
        Config("torch every:2", lambda m: _torch_ac(m, block_cls, 2)),
    ]
    if hf:
        configs.append(Config("HF gc", _hf_gc))
    return configs


def _budget_configs(none_peak: int, static: int, example: Any) -> list[Config]:
    act = none_peak - static
    out = []
    for frac in (0.25, 0.5, 0.75):
        size = int(static + frac * act)
        out.append(Config(
            f"budget {int(frac * 100)}%",
            lambda m, size=size: distckpt.wrap(m, Budget(size, strategy="none"), example_inputs=example),
            budget=size,
        ))
    return out


def run_model(label: str, base: nn.Module, block_cls: type, inputs: tuple, kwargs: dict, device: torch.device,
              rounds: int, hf: bool) -> list[Config]:
    """Measure every configuration on one model; returns them with their figures filled in."""
    base = base.to(device).train()
    example = kwargs if kwargs else inputs
    configs = _configs(block_cls, hf)
    blocks = [(n, m) for n, m in base.named_modules() if isinstance(m, block_cls)]
    static, _ = static_bytes(profile_model(base, blocks, example), strategy="none")
    # "none" runs first: its peak sets the budgets.
    all_configs = configs
    for cfg in all_configs:
        _prepare(cfg, base, inputs, kwargs, device, block_cls)
        if cfg.name == "none":
            all_configs = configs + _budget_configs(cfg.peak, static, example)
    for cfg in all_configs[len(configs):]:
        _prepare(cfg, base, inputs, kwargs, device, block_cls)
    ok = [c for c in all_configs if not c.error]
    none = next(c for c in ok if c.name == "none")
    base_flops = none.flops
    for c in ok:
        c.flops -= base_flops
    # Interleaved timing: one step of each configuration per round, so drift hits all alike.
    opts = {c.name: torch.optim.AdamW(c.model.parameters(), lr=1e-4) for c in ok}
    for c in ok:  # warm-up
        _step(c.model, opts[c.name], inputs, kwargs)
    # On CPU the process's CPU time, not wall time: a shared machine's other load does not count.
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    for _ in range(rounds):
        for c in ok:
            _sync(device)
            t0 = clock()
            _step(c.model, opts[c.name], inputs, kwargs)
            _sync(device)
            c.times.append(clock() - t0)
    for c in all_configs:
        c.model = None
    print(f"[{label}] done")
    return all_configs


def _prepare(cfg: Config, base: nn.Module, inputs: tuple, kwargs: dict, device: torch.device, block_cls: type) -> None:
    torch.manual_seed(0)
    try:
        model = cfg.build(copy.deepcopy(base))
    except ConfigError as e:
        cfg.error = str(e).split(";")[0].split(":")[0] if "no choice" not in str(e) else _no_fit(str(e))
        return
    cfg.checkpointed = sum(1 for m in model.modules() if isinstance(m, block_cls) and is_checkpointed(m))
    cfg.checkpointed += sum(1 for m in model.modules() if type(m).__name__ == "CheckpointWrapper")
    if cfg.name == "HF gc":
        cfg.checkpointed = sum(1 for m in model.modules() if isinstance(m, block_cls))
    cfg.flops = _fwd_bwd_flops(model, inputs, kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _step(model, opt, inputs, kwargs)  # creates the optimizer state: measure the steady state
    cfg.peak = _peak(model, opt, inputs, kwargs, device)
    cfg.model = model


def _no_fit(msg: str) -> str:
    import re

    m = re.search(r"budget:(\d+) or more", msg)
    return f"no placement fits; smallest is {int(m.group(1)) / 2**20:.2f} MiB" if m else msg


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _table(label: str, configs: list[Config], fwd_bwd_flops: int) -> list[str]:
    none = next(c for c in configs if c.name == "none")
    base_t = statistics.median(none.times)
    names = {c.name: c for c in configs}
    rows = [
        f"### {label}",
        "",
        "| configuration | blocks checkpointed | peak MiB | peak vs none | recompute GFLOP (% of fwd+bwd) "
        "| step time vs none (median) | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in configs:
        if c.error:
            rows.append(f"| {c.name} | - | - | - | - | - | {c.error} |")
            continue
        ratio = statistics.median(c.times) / base_t
        notes = []
        if c.budget is not None:
            notes.append(f"budget {_mib(c.budget)} MiB: {'within' if c.peak <= c.budget else 'EXCEEDED'}")
        if c.peer and c.peer in names and not names[c.peer].error:
            p = names[c.peer]
            peer_ratio = statistics.median(p.times) / base_t
            notes.append(f"vs {c.peer}: peak {c.peak - p.peak:+d} B, time x{ratio / peer_ratio:.3f}")
        rows.append(
            f"| {c.name} | {c.checkpointed} | {_mib(c.peak)} | {c.peak / none.peak:.1%} | "
            f"{c.flops / 1e9:.3f} ({c.flops / max(fwd_bwd_flops, 1):.1%}) | {ratio:.3f} | {'; '.join(notes)} |"
        )
    return [*rows, ""]


def _plot(results: dict[str, list[Config]], path: Path, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4.5), squeeze=False)
    for ax, (label, configs) in zip(axes[0], results.items()):
        none = next(c for c in configs if c.name == "none")
        base_t = statistics.median(none.times)
        for k, c in enumerate(c for c in configs if not c.error):
            x, y = statistics.median(c.times) / base_t, c.peak / 2**20
            peer = c.name.startswith(("torch", "HF"))
            ax.scatter([x], [y], marker="s" if peer else "o", s=40, color="tab:red" if peer else "tab:blue")
            # Staggered labels: configurations with the same placement sit on the same point.
            ax.annotate(c.name, (x, y), textcoords="offset points", xytext=(5, 8 * (k % 3) - 8), fontsize=7)
        ax.set_xlabel("step time / no checkpointing (median)")
        ax.set_ylabel("peak training memory (MiB)")
        ax.set_title(label, fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle(f"distckpt (circles) vs PyTorch / Hugging Face (squares), {device}", fontsize=10)
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
        blocks.append(BlockProfile(f"b{i}", inp + rng.randint(0, 400) * 2**20, rng.randint(1, 1000) * 10**9, inp, inp,
                                   rng.randint(0, 100) * 2**20))
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
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sizes = args.sizes or (["medium", "large"] if cuda else ["small", "medium"])
    hf_size = args.hf_size or ("medium" if cuda else "small")
    bsz = args.batch or (8 if cuda else 2)
    rounds = args.rounds or (20 if cuda else 7)
    if not cuda:
        torch.set_num_threads(args.threads)

    results: dict[str, list[Config]] = {}
    flops_ref: dict[str, int] = {}
    models: list[tuple[str, Callable[[], nn.Module], type, GPTConfig, bool]] = [
        (f"GPT {s}", functools.partial(GPT, SIZES[s]), Block, SIZES[s], False) for s in sizes
    ]
    try:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        models.append((f"HF GPT-2 ({hf_size})", functools.partial(hf_gpt2, SIZES[hf_size]), GPT2Block,
                       SIZES[hf_size], True))
    except ImportError:
        print("transformers is not installed: skipping the Hugging Face GPT-2 model")
    for name, make, block_cls, cfg, hf in models:
        torch.manual_seed(0)
        model = make()
        idx, tgt = batch(cfg, bsz, device=device)
        inputs, kwargs = ((), {"input_ids": idx, "labels": idx}) if hf else ((idx, tgt), {})
        label = f"{name}: dim {cfg.dim}, {cfg.layers} layers, seq {cfg.seq}, vocab {cfg.vocab}, batch {bsz}"
        print(f"[{label}]")
        configs = run_model(label, model, block_cls, inputs, kwargs, device, rounds, hf)
        results[label] = configs
        m = model.to(device)
        flops_ref[label] = _fwd_bwd_flops(m, inputs, kwargs)

    args.out.mkdir(parents=True, exist_ok=True)
    tag = device.type
    md = args.out / f"memory_{tag}.md"
    png = args.out / f"memory_{tag}.png"
    lines = [
        f"# Memory vs time ({tag})",
        "",
        f"Generated by `python -m benchmarks.memory --device {tag}` on {platform.machine()} "
        f"({torch.cuda.get_device_name(device) if cuda else platform.processor() or 'CPU'}), torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads, {rounds} interleaved timed steps per "
        f"configuration ({'wall time' if cuda else 'process CPU time'}, median). One AdamW step (forward, "
        "backward, optimizer.step) in steady state; peak memory by "
        f"{'torch.cuda.max_memory_allocated' if cuda else 'MemTracker'}; recompute FLOPs by FlopCounterMode "
        "(forward+backward minus the run without checkpointing). Budgets are static memory (parameters, "
        "gradients, AdamW state, batch) plus 25/50/75% of the activation memory without checkpointing.",
        "",
        f"![memory vs time]({png.name})",
        "",
    ]
    for label, configs in results.items():
        lines += _table(label, configs, flops_ref[label])
    lines += [f"Planner: {_planner_seconds():.3f} s to place 100 blocks of random profiles (median of 5).", ""]
    md.write_text("\n".join(lines))
    _plot(results, png, tag)
    print(f"wrote {md} and {png}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
