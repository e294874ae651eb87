"""Write a nanoGPT-style token file (a flat binary of token ids) from a local text file, for ``data=tokens``.

    python scripts/make_tokens.py input.txt OUT_DIR [--tokenizer DIR] [--eval-fraction 0.1]

writes ``OUT_DIR/train.bin`` and ``OUT_DIR/val.bin`` (the last ``--eval-fraction`` of the ids). With
``--tokenizer DIR`` the ids come from a Hugging Face tokenizer saved in that local directory
(``AutoTokenizer.from_pretrained(DIR, local_files_only=True)``: nothing is downloaded); without it
they are the text's UTF-8 bytes (vocabulary 256). The ids are uint16 when the vocabulary fits
(< 65536), else uint32; the script prints the ``data.dtype`` and ``model.vocab_size`` to train with.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def encode(text: str, tokenizer_dir: str | None) -> tuple[list[int], int]:
    """The token ids of ``text`` and the vocabulary size."""
    if tokenizer_dir is None:
        return list(text.encode("utf-8")), 256
    from transformers import AutoTokenizer  # optional dependency (extra "hf")

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    return tok(text, add_special_tokens=False)["input_ids"], len(tok)


def write(ids: list[int], vocab_size: int, out_dir: Path, eval_fraction: float) -> dict[str, str]:
    """Write ``train.bin`` and ``val.bin``; the overrides that train on them."""
    dtype = "uint16" if vocab_size <= 2**16 else "uint32"
    arr = np.asarray(ids, dtype=dtype)
    cut = len(arr) - int(len(arr) * eval_fraction)
    out_dir.mkdir(parents=True, exist_ok=True)
    arr[:cut].tofile(out_dir / "train.bin")
    arr[cut:].tofile(out_dir / "val.bin")
    return {
        "data": "tokens",
        "data.path": str(out_dir / "train.bin"),
        "data.eval_path": str(out_dir / "val.bin"),
        "data.dtype": dtype,
        "model.vocab_size": str(vocab_size),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", type=Path, help="a local UTF-8 text file")
    parser.add_argument("out_dir", type=Path, help="where train.bin and val.bin go")
    parser.add_argument("--tokenizer", default=None, help="a local directory with a saved tokenizer (default: bytes)")
    parser.add_argument("--eval-fraction", type=float, default=0.1, help="the share of ids in val.bin (default 0.1)")
    args = parser.parse_args(argv)
    if not args.input.is_file():
        print(f"error: {args.input} is not a file", file=sys.stderr)
        return 2
    if not 0 <= args.eval_fraction < 1:
        print(f"error: --eval-fraction={args.eval_fraction} must be in [0, 1)", file=sys.stderr)
        return 2
    ids, vocab = encode(args.input.read_text(encoding="utf-8"), args.tokenizer)
    overrides = write(ids, vocab, args.out_dir, args.eval_fraction)
    print(f"wrote {len(ids)} tokens (vocabulary {vocab}); train with:")
    print("  " + " ".join(f"{k}={v}" for k, v in overrides.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
