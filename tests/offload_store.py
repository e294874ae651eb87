"""A host store for the ``"offload"`` mode that escapes torch's allocator, for tests on the CPU.

On CUDA, offloaded tensors go to pinned host memory, which the device's memory tracker does not
count; on a CPU step host memory *is* the step's memory. This store keeps the bytes in numpy arrays
(allocated by numpy, never seen by ``MemTracker`` or the CPU allocator's accounting of torch tensors)
and brings them back into a fresh torch tensor (``empty_strided``, which MemTracker sees, as it sees
the device allocation of a CUDA copy back). Only tests install it (``use_numpy_store``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from distckpt.runtime import recompute


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill ``numel`` consecutive slots of its storage (any order of dims)."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


class NumpyStore:
    """Counts what it moves: ``packs`` (tensors moved to the host), ``bytes`` (their bytes).

    ``Tensor.numpy()`` marks the tensor's storage not resizable: a parameter it were given (FSDP2 frees
    an unsharded parameter by resizing its storage to 0) would fail there, with "Trying to resize storage
    that is not resizable". The offload hooks never give it one (tests/distributed/test_offload_dist.py).
    """

    escapes_allocator = True

    def __init__(self) -> None:
        self.packs = 0
        self.unpacks = 0
        self.bytes = 0

    def to_host(self, t: torch.Tensor) -> Any:
        t = t.detach()
        if not _dense(t):
            t = t.contiguous()  # a temporary torch sees; the kept copy is numpy's
        flat = t.as_strided((t.numel(),), (1,)) if t.numel() else t.reshape(-1)
        # Tensor.numpy() is no dispatched op: neither the view nor the copy reaches MemTracker.
        data = flat.view(torch.uint8).numpy().copy() if flat.numel() else None
        self.packs += 1
        self.bytes += t.numel() * t.element_size()
        return (tuple(t.shape), t.stride(), t.dtype, data)

    def to_device(self, packed: Any) -> torch.Tensor:
        shape, stride, dtype, data = packed
        out = torch.empty_strided(shape, stride, dtype=dtype)  # the "device" allocation MemTracker sees
        if data is not None:
            out.as_strided((out.numel(),), (1,)).view(torch.uint8).numpy()[:] = data
        self.unpacks += 1
        return out


@contextlib.contextmanager
def use_numpy_store() -> Iterator[NumpyStore]:
    """Install a :class:`NumpyStore` as the offload mode's store (the ``recompute.host_store`` seam)."""
    store = NumpyStore()
    original = recompute.host_store
    recompute.host_store = lambda: store
    try:
        yield store
    finally:
        recompute.host_store = original
