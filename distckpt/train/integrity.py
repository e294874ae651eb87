"""Checkpoint integrity: a manifest of every file's size and CRC32, written before the atomic rename, checked on resume.

DCP itself checks nothing: a truncated shard fails deep inside a load, and flipped bytes load silently
(measured: 4 KiB of flipped bytes in a shard loaded, and the next update went NaN). CRC32 (zlib) rather than
a cryptographic hash: corruption, not tampering, is the threat, and it is the fastest (measured on one CPU
core: crc32 2.3 GB/s, sha256 1.0 GB/s, blake2b 0.44 GB/s). The files are hashed in parallel, each rank a
share, so the cost per rank shrinks with the job (see docs/launcher.md for the measured cost vs the save).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Any

import torch.distributed as dist

from distckpt._dist import broadcast_object, rank_world

__all__ = ["MANIFEST", "has_manifest", "verify_checkpoint", "write_manifest"]

MANIFEST = "manifest.json"
_CHUNK = 16 * 2**20


def _crc32(path: Path) -> int:
    buf = memoryview(bytearray(_CHUNK))  # one buffer, refilled: no allocation per chunk
    crc = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(buf[:n], crc)
    return crc


def _gather(mine: dict[str, Any]) -> dict[str, Any]:
    """Every rank's ``mine`` merged, on every rank."""
    if not dist.is_initialized():
        return dict(mine)
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


def write_manifest(folder: str | os.PathLike[str]) -> None:
    """Write ``folder/manifest.json`` (size and CRC32 of every other file); call it on every rank.

    Each rank hashes a share of the files (the folder must be the same path on every rank, as DCP
    already requires for a multi-node save); rank 0 writes the manifest.
    """
    folder = Path(folder)
    rank, world = rank_world()
    names = broadcast_object(
        sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST) if rank == 0 else None
    )
    mine = {n: {"size": (folder / n).stat().st_size, "crc32": _crc32(folder / n)} for n in names[rank::world]}
    files = _gather(mine)
    if rank == 0:
        body = json.dumps({"version": 1, "checksum": "crc32", "files": dict(sorted(files.items()))}, indent=1)
        with open(folder / MANIFEST, "w") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())


def has_manifest(folder: str | os.PathLike[str]) -> bool:
    """Whether ``folder`` holds a manifest (checkpoints of distckpt before 0.1 have none)."""
    return (Path(folder) / MANIFEST).is_file()


def _check_share(folder: Path, files: dict[str, Any], rank: int, world: int) -> list[str]:
    problems = []
    for name in sorted(files)[rank::world]:
        path, want = folder / name, files[name]
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif (size := path.stat().st_size) != want["size"]:
            problems.append(f"{name} has {size} bytes, the manifest says {want['size']}")
        elif _crc32(path) != want["crc32"]:
            problems.append(f"{name} does not match its checksum (corrupted bytes)")
    return problems


def verify_checkpoint(folder: str | os.PathLike[str]) -> list[str]:
    """Check ``folder`` against its manifest; call it on every rank (each checks a share of the files).

    Returns:
        What is wrong (the same list on every rank), empty if every file has its recorded size and
        checksum. A folder without a manifest gives an empty list: see :func:`has_manifest`.
    """
    folder = Path(folder)
    rank, world = rank_world()
    files: Any = None
    if rank == 0 and has_manifest(folder):
        try:
            files = json.loads((folder / MANIFEST).read_text())["files"]
        except (ValueError, KeyError, OSError) as e:
            files = f"{MANIFEST} is unreadable ({type(e).__name__})"
    files = broadcast_object(files)
    if files is None:
        return []
    if isinstance(files, str):
        return [files]
    problems = _gather({str(rank): _check_share(folder, files, rank, world)})
    return [p for r in sorted(problems, key=int) for p in problems[r]]
