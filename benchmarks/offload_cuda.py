"""The "offload" mode on CUDA: ``python -m benchmarks.offload_cuda`` (one GPU, under 3 minutes on an H200).

On a Hugging Face GPT-2 built from ``GPT2Config`` (random weights, no download; the same-shaped GPT of
tests/models.py where transformers is not installed): the measured exchange
rate ``flops_per_byte`` (matmul FLOP/s over pinned host-link bytes/s, :mod:`distckpt.select.profile.transfer`),
then for no checkpointing, ``full``, every block offloaded, and a budget halfway between ``full``'s and
no checkpointing's predicted peaks planned with offload offered: the device peak of a forward+backward
(``torch.cuda.max_memory_allocated``, parameters, gradients and batch included; no optimizer), its
prediction (:func:`distckpt.select.budget.predicted_peak`), and the median step time (CUDA events, 5
steps after 2 warm-ups, interleaved rounds). Writes ``offload_cuda.md`` into ``--out`` (default
``benchmarks/results/``); ``benchmarks/cuda_session.sh`` runs it as ``python3 benchmarks/offload_cuda.py``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from models import GPT, GPTConfig, batch, hf_gpt2

import distckpt
from distckpt.select.blocks import find_blocks
from distckpt.select.budget import plan_budget, predicted_peak
from distckpt.select.policies import Placement
from distckpt.select.profile import flops_per_byte, profile_model

ROOT = Path(__file__).resolve().parents[1]

KW = dict(strategy="none", optimizer="none")


def _model(cfg: GPTConfig) -> tuple[torch.nn.Module, str]:
    """HF GPT-2 from a ``GPT2Config`` of ``cfg``'s size; the GPT of tests/models.py (the same layout)
    where transformers is not installed (a GPU machine's own python: ``benchmarks/cuda_session.sh``)."""
    torch.manual_seed(0)
    try:
        return hf_gpt2(cfg).cuda().train(), "HF GPT-2 (GPT2Config, sdpa)"
    except ImportError:
        return GPT(cfg).cuda().train(), "GPT of tests/models.py (transformers not installed)"


def _loss(model: torch.nn.Module, inputs: Any) -> torch.Tensor:
    """HF models get keyword arguments (their loss from ``labels``), the GPT an ``(idx, targets)`` tuple."""
    return model(**inputs).loss if isinstance(inputs, dict) else model(*inputs)


def _step(model: torch.nn.Module, inputs: Any) -> None:
    _loss(model, inputs).backward()
    model.zero_grad(set_to_none=True)


def _peak(model: torch.nn.Module, inputs: Any) -> int:
    _step(model, inputs)  # warm: the caching allocator's first-step blocks, cuBLAS workspaces
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    _step(model, inputs)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def _times(models: dict[str, torch.nn.Module], inputs: Any, rounds: int = 5) -> dict[str, float]:
    """Median milliseconds per step, the variants interleaved in each round (A/B, not one after another)."""
    out: dict[str, list[float]] = {k: [] for k in models}
    for m in models.values():
        for _ in range(2):
            _step(m, inputs)
    for _ in range(rounds):
        for name, m in models.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            _step(m, inputs)
            end.record()
            torch.cuda.synchronize()
            out[name].append(start.elapsed_time(end))
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks" / "results",
        help="a folder (offload_cuda.md is written there) or a .md file",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.offload_cuda needs a CUDA device")
    out = args.out if args.out.suffix == ".md" else args.out / "offload_cuda.md"
    t0 = time.time()
    cfg = GPTConfig(vocab=8192, seq=args.seq, dim=args.width, heads=args.width // 64, layers=args.layers)
    base, what = _model(cfg)
    idx, tgt = batch(cfg, args.batch, device="cuda", seed=1)
    inputs = {"input_ids": idx, "labels": idx} if hasattr(base, "config") else (idx, tgt)
    blocks = find_blocks(base)
    n = len(blocks)
    mp = profile_model(base, blocks, inputs, modes=("full", "offload"))
    ratio = flops_per_byte(mp, torch.device("cuda"), torch.float32)
    none_p, full_p = predicted_peak(mp, [], **KW), predicted_peak(mp, range(n), **KW)
    budget = (none_p + full_p) // 2
    plan = plan_budget(mp, budget, offload_flops_per_byte=ratio, selective=False, **KW)
    rows = {
        "none": ("none",) * n,
        "full": ("full",) * n,
        "offload (every block)": ("offload",) * n,
        f"budget {budget / 2**20:.0f} MiB (offload offered)": plan.modes,
    }
    models = {name: distckpt.wrap(copy.deepcopy(base), Placement(modes)) for name, modes in rows.items()}
    peaks = {name: _peak(m, inputs) for name, m in models.items()}
    times = _times(models, inputs)
    lines = [
        "# Offload mode on CUDA (measured)",
        "",
        f"Device: {torch.cuda.get_device_name()}; torch {torch.__version__}. {what}: "
        f"{args.layers} layers, width {args.width}, seq {args.seq}, batch {args.batch}, fp32, no optimizer.",
        "",
        f"Measured exchange rate: **{ratio:.1f} FLOPs per byte** moved to host and back "
        "(matmul FLOP/s over pinned-copy bytes/s, `distckpt.select.profile.flops_per_byte`).",
        "",
        f"Budget plan: {', '.join(f'{m} x{plan.modes.count(m)}' for m in sorted(set(plan.modes)))}; "
        f"{plan.moved_bytes / 2**20:.1f} MiB moved per step; recompute {plan.recompute_flops / 1e9:.2f} GFLOP, "
        f"transfers {plan.transfer_flops / 1e9:.2f} GFLOP-equivalent.",
        "",
        "| placement | predicted peak (MiB) | measured peak (MiB) | error | step (ms, median) | vs none |",
        "|---|---|---|---|---|---|",
    ]
    for name, modes in rows.items():
        pred, meas = predicted_peak(mp, modes, **KW), peaks[name]
        lines.append(
            f"| {name} | {pred / 2**20:.1f} | {meas / 2**20:.1f} | {100 * (pred - meas) / meas:+.2f}% | "
            f"{times[name]:.1f} | {times[name] / times['none']:.2f}x |"
        )
    lines += ["", f"Wall time of this benchmark: {time.time() - t0:.0f} s.", ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
