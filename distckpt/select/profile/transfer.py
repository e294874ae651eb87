"""What one byte over the host link costs in FLOPs on this device: the exchange rate that puts the
``"offload"`` mode (bytes moved, no recompute) on the budget's FLOP scale.

``flops_per_byte = achieved matmul FLOP/s / host-link bytes/s``, both timed on the device with CUDA
events, once per device (and dtype, and size), cached for the process: a matmul shaped like the
blocks' linear layers and a pinned-memory copy of the largest block's offloaded bytes, each way.
Every rank takes the largest ratio measured by any rank, so that every rank plans the same blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from distckpt.errors import ConfigError

if TYPE_CHECKING:
    from distckpt.select.profile.profile import ModelProfile

__all__ = ["flops_per_byte", "probe_shapes"]

_CACHE: dict[tuple[str, int, torch.dtype, tuple[int, int, int], int], float] = {}


def probe_shapes(mp: ModelProfile, dtype: torch.dtype) -> tuple[tuple[int, int, int], int]:
    """``((m, k, n), copy bytes)`` to time: a ``(m, k) @ (k, n)`` matmul like a transformer block's
    (width ``k`` from its parameter count, ``12 k**2`` for attention + a 4x MLP; ``n = 4k``; ``m`` the
    tokens, from its forward FLOPs ``~ 2 * m * params``), and the largest block's offloaded bytes."""
    size = torch.empty((), dtype=dtype).element_size()
    params = max(1, mp.block_param_bytes // size)
    k = max(64, min(16384, 64 * round(math.sqrt(params / 12) / 64)))
    flops = max((b.forward_flops for b in mp.blocks), default=0)
    m = max(64, min(65536, 64 * round(flops / (2 * params) / 64)))
    nbytes = max(2**20, max((b.offload_bytes for b in mp.blocks), default=0))
    return (m, k, 4 * k), nbytes


def _time_ms(fn: Callable[[], object], device: torch.device, reps: int = 5) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs after two warm-ups, timed with CUDA events."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _measure(device: torch.device, dtype: torch.dtype, mkn: tuple[int, int, int], nbytes: int) -> float:
    m, k, n = mkn
    a, b = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
    flop_s = 2 * m * k * n / (_time_ms(lambda: a @ b, device) / 1e3)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out = _time_ms(lambda: host.copy_(dev, non_blocking=True), device)
    back = _time_ms(lambda: dev.copy_(host, non_blocking=True), device)
    link = 2 * nbytes / ((out + back) / 1e3)  # bytes/s, averaged over both directions
    return flop_s / link


def _agree(ratio: float, device: torch.device) -> float:
    """The largest ratio any rank measured (transfers priced highest: offload chosen the least)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return ratio
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([ratio], dtype=torch.float64, device=on)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def flops_per_byte(mp: ModelProfile, device: torch.device, dtype: torch.dtype = torch.float32) -> float:
    """The measured FLOPs per byte moved over the host link on ``device`` (see the module docstring).

    Args:
        mp: the profile (the shapes to time: :func:`probe_shapes`).
        device: a CUDA device.
        dtype: the dtype of the blocks' matmuls (under autocast, give the ratio yourself:
            ``Budget(offload_flops_per_byte=...)``; this times ``dtype``).

    Returns:
        FLOPs per byte (every rank the same value; collective under ``torch.distributed``).

    Raises:
        ConfigError: off CUDA, where host memory is the step's own memory.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ConfigError(
            f"offload's FLOPs per byte is measured on CUDA only; on {device.type} host memory is the "
            "step's own memory. Give Budget(offload_flops_per_byte=...) to plan offload anyway."
        )
    import torch.distributed as dist

    mkn, nbytes = probe_shapes(mp, dtype)
    index = device.index if device.index is not None else torch.cuda.current_device()
    # The world size is part of the key, as in the profile's cache: a ratio measured before the process
    # group existed was not agreed between the ranks (the plan redone at parallelize must not reuse it).
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    key = ("cuda", index, dtype, mkn, world)
    if key not in _CACHE:
        with torch.cuda.device(index):
            _CACHE[key] = _agree(_measure(torch.device("cuda", index), dtype, mkn, nbytes), device)
    return _CACHE[key]
