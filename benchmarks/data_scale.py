"""Data at scale: resume cost against the position, and peak memory of the stream against the data set's size.

    python -m benchmarks.data_scale [--rounds 3] [--sizes 10000,100000,1000000]

1. **Resume cost**: a small GPT's training state with a loader at step 10 and at step 10,000 (batches of 8
   windows of 16 tokens from a generated JSONL file through ``data=hf``), saved with ``save_checkpoint``; each
   round resumes both (``resume_latest`` into a fresh model, optimizer and loader, then the first batch),
   interleaved, and the table gives the medians and their ratio. Three kinds of data: the token cache
   (``data=hf``, map-style), the stream (``data=hf data.streaming=true``: readers resumed from their state)
   and, for contrast, the same stream without state and shard hook (replayed up to the position). Each
   resumed first batch is checked against the batch the saved loader gives next.
2. **Peak RSS**: one process per size reads one epoch of a generated JSONL file of that many documents
   through the stream (``ShardedLoader`` over ``PackedText``, no worker processes, so the process holds
   everything) and reports its peak RSS; for contrast, ``datasets.load_dataset(..., keep_in_memory=True)``
   of the same file.

Writes ``benchmarks/results/data_resume.md`` and ``benchmarks/results/data_rss.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
SEQ, BATCH, FAR, NEAR, FILES = 16, 8, 10_000, 10, 16


def _helpers() -> Any:
    # The tests' generated documents and tokenizer: tests/launch/launchkit.py, a folder benchmarks/__init__.py
    # does not put on the path.
    sys.path.insert(0, str(ROOT / "tests" / "launch"))
    import launchkit

    return launchkit


def _cfg(path: Path | str, tok: Path, cache: Path, *extra: str) -> Any:
    from launch.check import compose

    over = [
        "model.vocab_size=64",
        f"model.seq_len={SEQ}",
        "model.n_layer=2",
        "model.d_model=32",
        "model.n_head=2",
        "data=hf",
        f"data.path={path}",
        f"data.tokenizer={tok}",
        f"data.cache_dir={cache}",
        f"data.batch_size={BATCH}",
        *extra,
    ]
    return compose(over)


class _Stateless(IterableDataset):
    """The stream without ``state_dict`` and shard hook: the loader replays it (today's fallback)."""

    def __init__(self, stream: IterableDataset) -> None:
        self.stream = stream

    def __iter__(self):  # noqa: ANN204
        return iter(self.stream)


def _state(cfg: Any, loader: Any) -> Any:
    from distckpt.train import TrainState
    from launch.build import build_model, build_optimizer

    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.data)
    opt, sched = build_optimizer(cfg.optim, model, 20_000)
    return TrainState(model, opt, sched, data=loader)


def _resume_rows(root: Path, rounds: int) -> list[tuple[str, float, float]]:
    from distckpt.train import resume_latest, save_checkpoint
    from distckpt.train.data import ShardedLoader
    from launch.build import build_datasets

    kit = _helpers()
    docs = kit.write_jsonl(root / "docs.jsonl", 150_000)  # ~1.6M tokens: 10,000 batches of 8 x 16 and more
    tok = kit.write_tokenizer(root / "tok")
    (root / "parts").mkdir()
    lines = docs.read_text().splitlines(keepends=True)
    for k in range(FILES):  # the same documents in files of consecutive lines
        (root / "parts" / f"part{k:02d}.jsonl").write_text(
            "".join(lines[k * len(lines) // FILES : (k + 1) * len(lines) // FILES])
        )
    parts = root / "parts" / "*.jsonl"
    kinds = {
        "token cache (data=hf, map-style)": lambda: build_datasets(*_parts(docs, tok, root))[0],
        "stream (data.streaming=true)": lambda: build_datasets(*_parts(docs, tok, root, "data.streaming=true"))[0],
        f"stream of {FILES} files (data.path=DIR/*.jsonl)": lambda: build_datasets(
            *_parts(parts, tok, root, "data.streaming=true")
        )[0],
        "stream without state (replayed)": lambda: _Stateless(
            build_datasets(*_parts(docs, tok, root, "data.streaming=true"))[0]
        ),
    }
    rows = []
    for name, make in kinds.items():
        cfg = _cfg(docs, tok, root / "cache")
        dirs, expected = {}, {}
        for steps in (NEAR, FAR):
            loader = ShardedLoader(make(), BATCH, rank=0, world_size=1)
            if loader.kind == "shards":
                for _ in range(steps):  # real reader states at that step
                    loader.next_batch()
            else:
                loader.load_state_dict({"epoch": 0, "batch": steps, "world_size": 1})
            state = _state(cfg, loader)
            state.step = steps
            dirs[steps] = root / f"ckpt-{len(rows)}-{steps}"
            save_checkpoint(state, dirs[steps])
            expected[steps] = loader.next_batch()["tokens"]
        times: dict[int, list[float]] = {NEAR: [], FAR: []}
        for _ in range(rounds):
            for steps in (NEAR, FAR):  # interleaved: the machine's load hits both alike
                state = _state(cfg, ShardedLoader(make(), BATCH, rank=0, world_size=1))
                t0 = time.perf_counter()
                resume_latest(state, dirs[steps])
                first = state.data.next_batch()["tokens"]
                times[steps].append(time.perf_counter() - t0)
                assert torch.equal(first, expected[steps]), f"{name}: the resumed batch at {steps} differs"
        rows.append((name, statistics.median(times[NEAR]), statistics.median(times[FAR])))
    return rows


def _parts(docs: Path | str, tok: Path, root: Path, *extra: str) -> tuple[Any, Any]:
    cfg = _cfg(docs, tok, root / "cache", *extra)
    return cfg.data, cfg.model


def _peak_rss_mib() -> float:
    """This process's peak RSS (``VmHWM``). Not ``getrusage``'s ``ru_maxrss``: Linux carries that over from the
    parent across fork and exec, so every child reported the benchmark's own 639 MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: the best there is


def _rss_child(path: str, tok: str, mode: str) -> None:
    """One process: read all of ``path`` one way, print peak RSS (MiB) and what was read, as JSON."""
    t0 = time.perf_counter()
    import datasets  # the imports are the same in both modes: the peak above them is the data's
    import transformers  # noqa: F401

    before = _peak_rss_mib()
    if mode == "stream":
        from distckpt.train.data import ShardedLoader
        from launch.build import build_datasets

        cfg = _cfg(Path(path), Path(tok), Path(tempfile.mkdtemp()), "data.streaming=true")
        loader = ShardedLoader(build_datasets(cfg.data, cfg.model)[0], BATCH, rank=0, world_size=1)
        n = 0
        while loader.epoch == 0:
            loader.next_batch()
            n += 1
        what = f"{n} batches"
    else:
        ds = datasets.load_dataset("json", data_files=path, split="train", keep_in_memory=True)
        what = f"{len(ds)} rows"
    peak = _peak_rss_mib()
    print(json.dumps({"peak": peak, "start": before, "what": what, "s": time.perf_counter() - t0}))


def _rss_rows(root: Path, sizes: list[int]) -> list[tuple[int, float, dict[str, dict[str, Any]]]]:
    kit = _helpers()
    tok = kit.write_tokenizer(root / "tok")
    rows = []
    for n in sizes:
        path = kit.write_jsonl(root / f"docs{n}.jsonl", n)
        out = {}
        for mode in ("stream", "in_memory"):
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.data_scale", "--rss-child", str(path), str(tok), mode],
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
            )
            out[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        rows.append((n, path.stat().st_size / 2**20, out))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--parts", default="resume,rss", help="resume, rss or both (comma-separated)")
    ap.add_argument("--rss-child", nargs=3, metavar=("PATH", "TOKENIZER", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    if args.rss_child:
        _rss_child(*args.rss_child)
        return
    torch.set_num_threads(1)
    parts = args.parts.split(",")
    with tempfile.TemporaryDirectory(prefix="distckpt-data-") as tmp:
        resume = _resume_rows(Path(tmp), args.rounds) if "resume" in parts else []
        rss = _rss_rows(Path(tmp), [int(s) for s in args.sizes.split(",")]) if "rss" in parts else []
    head = (
        f"{platform.machine()}, torch {torch.__version__}, one process, a 2-core machine shared with other jobs "
        "(loaded: absolute times are noisy; ratios come from one interleaved run). `python -m benchmarks.data_scale`."
    )
    RESULTS.mkdir(exist_ok=True)
    if "resume" in parts:
        _write(
            "data_resume.md", [f"# Resume at step {FAR:,} vs step {NEAR}", "", head, "", *_resume_table(resume, args)]
        )
    if "rss" in parts:
        _write("data_rss.md", ["# Peak RSS of one epoch of a stream", "", head, "", *_rss_table(rss)])


def _write(name: str, lines: list[str]) -> None:
    (RESULTS / name).write_text("\n".join([*lines, ""]))
    print("\n".join(lines))


def _resume_table(rows: list[tuple[str, float, float]], args: Any) -> list[str]:
    return [
        f"A small GPT (2 layers, d_model 32) + AdamW, batches of {BATCH} windows of {SEQ} tokens from a generated "
        f"JSONL file of 150,000 documents; `resume_latest` + the first batch, median of {args.rounds} interleaved "
        "rounds. Each resumed batch equals the one the saved loader gives next.",
        "",
        f"| data | resume at step {NEAR} (s) | at step {FAR:,} (s) | ratio |",
        "|---|---|---|---|",
        *(f"| {name} | {near:.3f} | {far:.3f} | {far / near:.2f} |" for name, near, far in rows),
    ]


def _rss_table(rows: list[tuple[int, float, dict[str, dict[str, Any]]]]) -> list[str]:
    return [
        "One process per size (no DataLoader workers: the process holds the reader's buffers), reading every "
        "document of a generated JSONL file through `data=hf data.streaming=true` (blocks of 256 windows); "
        "for contrast `datasets.load_dataset('json', keep_in_memory=True)` of the same file. Peak RSS is the "
        "process's VmHWM; the imports (torch, transformers, datasets) come first and are the same in both.",
        "",
        "| documents | file (MiB) | stream: peak RSS (MiB) | after the imports | read | time (s) | "
        "in memory: peak RSS (MiB) |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {n:,} | {mib:.1f} | {o['stream']['peak']:.0f} | {o['stream']['start']:.0f} | {o['stream']['what']} | "
            f"{o['stream']['s']:.1f} | {o['in_memory']['peak']:.0f} |"
            for n, mib, o in rows
        ),
    ]


if __name__ == "__main__":
    main()
