"""What every sample step of the profile shares: the loss it calls backward on, storages counted once,
MemTracker made (frozen parameters too) and read, and the model's state kept as it was.

:mod:`distckpt.select.profile` re-exports the public names (``scalar_loss``, ``memory_tracker``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from distckpt import _torch_compat as compat


def scalar_loss(out: Any) -> torch.Tensor:
    """A scalar to call ``backward`` on, from what a model returns.

    A ``loss`` attribute or key (Hugging Face models given labels) is used as is; otherwise the sum
    of every floating tensor output that requires grad. A sum saves nothing for backward, so the
    profile sees only what the model itself holds.

    Raises:
        ValueError: when the output holds no tensor that requires grad.
    """
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return loss
    leaves, _ = compat.tree_flatten(out)
    if not leaves and hasattr(out, "to_tuple"):  # Hugging Face ModelOutput
        leaves, _ = compat.tree_flatten(out.to_tuple())
    parts = [t.float().sum() for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
    if not parts:
        raise ValueError(
            "the model's output holds no tensor that requires grad, so no backward can be profiled; "
            "pass example_inputs that make the model return its loss (or logits) in training mode."
        )
    return torch.stack(parts).sum()


def _local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of ``t``: a DTensor's (tensor parallel) local shard, any other tensor itself."""
    if isinstance(t, DTensor):
        with torch.no_grad():  # the shard itself, no autograd node
            return t.to_local()
    return t


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    # The storage's identity, not its data_ptr(): the same on real tensors, and it also tells fake
    # tensors apart (distckpt plan profiles under FakeTensorMode, where every data_ptr() is 0).
    t = _local(t)
    return (str(t.device), compat.storage_id(t))


def _storage_bytes(t: torch.Tensor) -> int:
    return _local(t).untyped_storage().nbytes()


def _tensors(value: Any) -> list[torch.Tensor]:
    leaves, _ = compat.tree_flatten(value)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _distinct_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        seen[_storage_key(t)] = _storage_bytes(t)
    return sum(seen.values())


@contextlib.contextmanager
def _preserved_state(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Leave the model as it was: gradients, buffers (BatchNorm statistics) and the RNG streams."""
    grads = {p: p.grad for p in model.parameters()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            for p in grads:
                p.grad = None
            yield
        finally:
            for p, g in grads.items():
                p.grad = g
            with torch.no_grad():
                for b, v in buffers:
                    b.copy_(v)


def memory_tracker(*external: Any) -> Any:
    """A ``MemTracker`` tracking ``external`` (modules, optimizers, tensors) that also works on
    models with frozen parameters (LoRA), for one ``with`` block.

    MemTracker registers a gradient hook on every parameter of each module it sees run, and
    ``register_hook`` raises on a tensor that does not require grad. A frozen parameter never gets a
    gradient, so it needs no hook: each one is marked as already hooked (a no-op handle).

    Returns:
        A ``torch.distributed._tools.mem_tracker.MemTracker``, not yet entered.
    """
    leaves, _ = compat.tree_flatten(external)
    frozen = [p for m in leaves if isinstance(m, nn.Module) for p in m.parameters() if not p.requires_grad]
    tracker = compat.mem_tracker(frozen)
    tracker.track_external(*external)
    return tracker


def _at(snap: dict[Any, dict[str, int]], dev: torch.device) -> dict[str, int]:
    """One device's entry of a MemTracker snapshot (the only device on a CPU-only step)."""
    return snap.get(dev) or next(iter(snap.values()), {})


def _act(d: dict[str, int]) -> int:
    return d.get("Activation", 0) + d.get("Temp", 0)


def _rng_state_bytes(device: torch.device) -> int:
    """Bytes of RNG state that non-reentrant checkpoint saves per block in ``device``'s memory (see
    :attr:`ModelProfile.rng_state_bytes`): ``torch.get_rng_state()`` on the CPU; none on an accelerator
    (``torch.cuda.get_rng_state()`` is a 16-byte CPU tensor, the device memory holds nothing of it)."""
    if device.type != "cpu":
        return 0
    state = torch.get_rng_state()
    return state.numel() * state.element_size()
