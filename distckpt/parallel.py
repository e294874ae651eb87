"""parallelize / ddp_kwargs / preflight / accumulate: DDP, FSDP and FSDP2 around checkpointed
blocks. (First cut: plain settings; the multi-task-safe design lands with the parallelize issue.)"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from distckpt.errors import ConfigError
from distckpt.wrap import is_checkpointed

__all__ = ["accumulate", "ddp_kwargs", "parallelize", "preflight"]

STRATEGIES = ("none", "ddp", "fsdp", "fsdp2")
GRAPHS = ("auto", "static", "dynamic")


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def ddp_kwargs(model: nn.Module, *, graph: str = "auto") -> dict[str, Any]:
    if graph not in GRAPHS:
        raise ConfigError(f"graph must be one of {GRAPHS}, got {graph!r}.")
    return {"find_unused_parameters": graph == "dynamic"}


def preflight(model: nn.Module) -> None:
    return None


def parallelize(model: nn.Module, strategy: str = "ddp", *, graph: str = "auto", device_mesh: Any = None,
                **kwargs: Any) -> nn.Module:
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy must be one of {STRATEGIES}, got {strategy!r}.")
    if strategy == "none":
        return model
    if not dist.is_initialized():
        raise ConfigError(f"strategy={strategy!r} needs torch.distributed initialized (run under torchrun).")
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        dev = _device()
        return DDP(model, device_ids=[dev] if dev.type == "cuda" else None, **{**ddp_kwargs(model, graph=graph), **kwargs})
    if strategy == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy
        import functools

        policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=is_checkpointed)
        return FSDP(model, auto_wrap_policy=policy, device_id=_device(), use_orig_params=True, **kwargs)
    from torch.distributed.fsdp import fully_shard

    for m in [m for m in model.modules() if is_checkpointed(m)]:
        fully_shard(m, mesh=device_mesh, **kwargs)
    fully_shard(model, mesh=device_mesh, **kwargs)
    return model


@contextlib.contextmanager
def accumulate(model: nn.Module) -> Iterator[None]:
    ctx = model.no_sync() if hasattr(model, "no_sync") else contextlib.nullcontext()
    with ctx:
        yield
