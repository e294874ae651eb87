"""The "offload" mode on CUDA: ``python -m benchmarks.offload_cuda`` (one GPU, under 3 minutes on an H200).

On a Hugging Face GPT-2 built from ``GPT2Config`` (random weights, no download): the measured exchange
rate ``flops_per_byte`` (matmul FLOP/s over pinned host-link bytes/s, :mod:`distckpt.select.transfer`),
then for no checkpointing, ``full``, every block offloaded, and a budget halfway between ``full``'s and
no checkpointing's predicted peaks planned with offload offered: the device peak of a forward+backward
(``torch.cuda.max_memory_allocated``, parameters, gradients and batch included; no optimizer), its
prediction (:func:`distckpt.select.budget.predicted_peak`), and the median step time (CUDA events, 5
steps after 2 warm-ups, interleaved rounds). Writes ``benchmarks/results/offload_cuda.md``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import distckpt  # noqa: E402
from distckpt.select.blocks import find_blocks  # noqa: E402
from distckpt.select.budget import plan_budget, predicted_peak  # noqa: E402
from distckpt.select.policies import Placement  # noqa: E402
from distckpt.select.profile import profile_model  # noqa: E402
from distckpt.select.transfer import flops_per_byte  # noqa: E402

KW = dict(strategy="none", optimizer="none")


def _model(layers: int, width: int, seq: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=8192, n_positions=seq, n_embd=width, n_layer=layers, n_head=width // 64,
                     resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(cfg).cuda().train()


def _step(model: torch.nn.Module, inputs: dict) -> None:
    model(**inputs).loss.backward()
    model.zero_grad(set_to_none=True)


def _peak(model: torch.nn.Module, inputs: dict) -> int:
    _step(model, inputs)  # warm: the caching allocator's first-step blocks, cuBLAS workspaces
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    _step(model, inputs)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def _times(models: dict[str, torch.nn.Module], inputs: dict, rounds: int = 5) -> dict[str, float]:
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
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "offload_cuda.md")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.offload_cuda needs a CUDA device")
    t0 = time.time()
    base = _model(args.layers, args.width, args.seq)
    gen = torch.Generator("cuda").manual_seed(1)
    ids = torch.randint(0, 8192, (args.batch, args.seq), device="cuda", generator=gen)
    inputs = {"input_ids": ids, "labels": ids}
    blocks = find_blocks(base)
    n = len(blocks)
    mp = profile_model(base, blocks, inputs, modes=("full", "offload"))
    ratio = flops_per_byte(mp, torch.device("cuda"), torch.float32)
    none_p, full_p = predicted_peak(mp, [], **KW), predicted_peak(mp, range(n), **KW)
    budget = (none_p + full_p) // 2
    plan = plan_budget(mp, budget, offload_flops_per_byte=ratio, selective=False, **KW)
    rows = {"none": ("none",) * n, "full": ("full",) * n, "offload (every block)": ("offload",) * n,
            f"budget {budget / 2**20:.0f} MiB (offload offered)": plan.modes}
    models = {name: distckpt.wrap(copy.deepcopy(base), Placement(modes)) for name, modes in rows.items()}
    peaks = {name: _peak(m, inputs) for name, m in models.items()}
    times = _times(models, inputs)
    lines = [
        "# Offload mode on CUDA (measured)", "",
        f"Device: {torch.cuda.get_device_name()}; torch {torch.__version__}. HF GPT-2 from GPT2Config: "
        f"{args.layers} layers, width {args.width}, seq {args.seq}, batch {args.batch}, fp32, no optimizer.", "",
        f"Measured exchange rate: **{ratio:.1f} FLOPs per byte** moved to host and back "
        "(matmul FLOP/s over pinned-copy bytes/s, `distckpt.select.transfer.flops_per_byte`).", "",
        f"Budget plan: {', '.join(f'{m} x{plan.modes.count(m)}' for m in sorted(set(plan.modes)))}; "
        f"{plan.moved_bytes / 2**20:.1f} MiB moved per step; recompute {plan.recompute_flops / 1e9:.2f} GFLOP, "
        f"transfers {plan.transfer_flops / 1e9:.2f} GFLOP-equivalent.", "",
        "| placement | predicted peak (MiB) | measured peak (MiB) | error | step (ms, median) | vs none |",
        "|---|---|---|---|---|---|",
    ]
    for name, modes in rows.items():
        pred, meas = predicted_peak(mp, modes, **KW), peaks[name]
        lines.append(f"| {name} | {pred / 2**20:.1f} | {meas / 2**20:.1f} | {100 * (pred - meas) / meas:+.2f}% | "
                     f"{times[name]:.1f} | {times[name] / times['none']:.2f}x |")
    lines += ["", f"Wall time of this benchmark: {time.time() - t0:.0f} s.", ""]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
