"""Cost of the checkpoint manifest (CRC32 of every file) vs the save: ``python -m benchmarks.checkpoint_integrity``.

One process saves a GPT's training state (weights + AdamW moments, ``distckpt.train.save_checkpoint``)
several times; each round times the whole save (DCP write + manifest + rename), the manifest alone
(``write_manifest`` on the written folder) and the verification on resume (``verify_checkpoint``),
and reports the medians. The files are fresh in the page cache, as they are right after a save and
on a resume on the same node; a cold read from a network file system costs more (bounded by its
read bandwidth, the same bytes DCP reads anyway to load). Writes
``benchmarks/results/checkpoint_integrity.md``.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from distckpt.train import TrainState, save_checkpoint, verify_checkpoint
from distckpt.train.integrity import write_manifest
from distckpt.train.models import MultiTaskGPT

RESULTS = Path(__file__).resolve().parent / "results"


def _timed(fn, *args) -> float:  # noqa: ANN001
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = MultiTaskGPT(vocab_size=8192, seq_len=64, d_model=args.d_model, n_layer=args.n_layer, n_head=8, n_classes=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sum(
        model({"tokens": torch.randint(0, 8192, (2, 64)), "label": torch.zeros(2, dtype=torch.long)}).values()
    ).backward()
    opt.step()
    state = TrainState(model, opt)
    root = Path(tempfile.mkdtemp(prefix="distckpt-integrity-"))
    saves, manifests, verifies, size = [], [], [], 0
    try:
        for i in range(args.rounds):
            state.step = i + 1
            saves.append(_timed(save_checkpoint, state, root))
            folder = root / f"step_{i + 1}"
            manifests.append(_timed(write_manifest, folder))
            verifies.append(_timed(verify_checkpoint, folder))
            size = sum(p.stat().st_size for p in folder.iterdir())
            shutil.rmtree(folder)  # one checkpoint on disk at a time
    finally:
        shutil.rmtree(root, ignore_errors=True)
    save, man, ver = (statistics.median(x) for x in (saves, manifests, verifies))
    params = sum(p.numel() for p in model.parameters())
    lines = [
        "# Checkpoint manifest cost (CRC32 of every file)",
        "",
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, one process, page cache warm; "
        f"GPT {params / 1e6:.1f}M params + AdamW = {size / 2**20:.0f} MiB per checkpoint, median of {args.rounds}.",
        "",
        "| | seconds | of the save |",
        "|---|---|---|",
        f"| save_checkpoint (DCP write + manifest + rename) | {save:.3f} | 100% |",
        f"| of which the manifest (write_manifest) | {man:.3f} | {man / save:.0%} |",
        f"| verify_checkpoint on resume | {ver:.3f} | {ver / save:.0%} |",
        "",
        f"CRC32 throughput here: {size / 2**20 / ver:.0f} MiB/s.",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "checkpoint_integrity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
