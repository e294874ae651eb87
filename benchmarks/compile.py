"""Step time of per-block ``torch.compile`` against eager, one CPU process: ``python -m benchmarks.compile``.

A GPT (``GPT`` of tests/models.py, every block checkpointed ``full``) trains with AdamW under four setups: no
checkpointing eager, checkpointing eager, checkpointing with each block compiled (``compile_blocks``, backend
``inductor``) and the whole checkpointed model compiled (``torch.compile(model)``, inductor). The first step of each
compiled setup (the compile) is timed on its own; then the setups' steps alternate, round by round (interleaved, so
load changes on a shared machine hit them alike), and each setup's median step time is reported as a ratio to
checkpointing eager. Losses of the compiled setups are compared with eager's (float rounding of fused kernels).
Writes ``benchmarks/results/compile_cpu.md``.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from models import GPT, GPTConfig, batch

import distckpt
from distckpt.apply.compile import compile_blocks

RESULTS = Path(__file__).resolve().parent / "results"
CONFIG = GPTConfig(vocab=512, seq=128, dim=128, heads=4, layers=8)  # tests/models.py SIZES["small"]


def _setups(backend: str) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    plain = GPT(CONFIG)
    eager = distckpt.wrap(copy.deepcopy(plain), "full")
    blocks = compile_blocks(distckpt.wrap(copy.deepcopy(plain), "full"), backend=backend)
    whole = torch.compile(distckpt.wrap(copy.deepcopy(plain), "full"), backend=backend)
    return {"no checkpointing": plain, "full, eager": eager, "full, compile_blocks": blocks, "full, whole model": whole}


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, inputs: tuple[torch.Tensor, ...]) -> float:
    opt.zero_grad(set_to_none=True)
    loss = model(*inputs)
    loss.backward()
    opt.step()
    return loss.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--backend", default="inductor")
    args = ap.parse_args()
    inputs = batch(CONFIG, args.batch)
    models = _setups(args.backend)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    first, losses = {}, {}
    for k, m in models.items():
        t = time.perf_counter()
        losses[k] = _step(m, opts[k], inputs)
        first[k] = time.perf_counter() - t
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(args.rounds):
        for k, m in models.items():
            t = time.perf_counter()
            _step(m, opts[k], inputs)
            times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["full, eager"]
    ref = losses["full, eager"]
    rows = [
        f"| {k} | {med[k] * 1e3:.1f} | {med[k] / base:.2f} | {first[k]:.1f} | {abs(losses[k] - ref):.1e} |"
        for k in models
    ]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    text = "\n".join(
        [
            "# Per-block torch.compile on CPU",
            "",
            f"`python -m benchmarks.compile --rounds {args.rounds} --batch {args.batch} --backend {args.backend}`: "
            f"GPT {CONFIG}, AdamW, batch {args.batch}, one process, {torch.get_num_threads()} threads, torch "
            f"{torch.__version__}, {platform.machine()}, load average {load:.1f} at the end (a shared machine: "
            "ratios of interleaved medians, not absolute times).",
            "",
            "| setup | median step (ms) | vs full, eager | first step (s) | loss diff, step 1 |",
            "|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "compile_cpu.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
