"""Everything FSDP1-specific (``FullyShardedDataParallel``, ``strategy="fsdp"``) in one place: its construction
around checkpointed blocks, the audit of an FSDP1 model someone else built, its mixed-precision policy and its
gradient clipping (flat parameters: only the wrapper can compute the global norm)."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from distckpt.errors import ConfigError
from distckpt.parallel.mesh import mesh_group
from distckpt.parallel.param_sync import _Unit
from distckpt.parallel.units import Owners, block_units
from distckpt.runtime.swap import _clean_fqn, is_checkpointed

__all__ = ["apply_fsdp1", "audit_fsdp1", "clip_grad_norm", "mixed_precision_kwargs"]


def apply_fsdp1(
    model: nn.Module,
    names: list[str],
    owners: Owners,
    device_mesh: Any,
    device: torch.device,
    kwargs: dict[str, Any],
) -> tuple[nn.Module, list[tuple[_Unit, bool]], Any]:
    """``FullyShardedDataParallel`` with one unit per block (checkpointing inside the units, pytorch#82203) and
    ``use_orig_params=True``; returns the wrapper, its units (the join in the inner module's hooks, where FSDP1 runs
    them unsharded) and the data-parallel group.

    Raises:
        ConfigError: ``use_orig_params=False`` or an ``auto_wrap_policy`` (distckpt chooses the units).
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    if kwargs.get("use_orig_params") is False:
        raise ConfigError(
            "use_orig_params=False hides each parameter's gradient inside a flat parameter, so distckpt cannot "
            "leave the gradient of a parameter no rank used as None. Remove use_orig_params (distckpt sets True)."
        )
    if "auto_wrap_policy" in kwargs:
        raise ConfigError(
            "auto_wrap_policy is set by distckpt.parallelize (one FSDP unit per block, so "
            "checkpointing sits inside the units, pytorch#82203). Remove it, or choose blocks in distckpt.wrap."
        )
    blocks, units, root = block_units(model, names, owners)
    unit_ids = {id(b) for _, b in blocks}
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in unit_ids)
    extra = {"device_mesh": device_mesh} if device_mesh is not None else {}
    group = kwargs["process_group"] if kwargs.get("process_group") is not None else mesh_group(device_mesh)
    wrapped = FSDP(
        model,
        auto_wrap_policy=policy,
        device_id=kwargs.pop("device_id", device),
        use_orig_params=True,
        **extra,
        **kwargs,
    )
    return wrapped, [(u, False) for u in [*units, root]], group


def audit_fsdp1(model: nn.Module) -> None:
    """``preflight``'s FSDP1 check: every checkpointed block sits inside its own unit (else the whole model is
    unsharded during its recompute).

    Raises:
        ConfigError: naming the block and the fix.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    if not isinstance(model, FullyShardedDataParallel):
        return
    units = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
    for name, m in model.named_modules():
        if is_checkpointed(m) and not any(
            m is u.module or any(m is c for c in u.module.modules()) for u in units if u is not model
        ):
            raise ConfigError(
                f"checkpointed block {_clean_fqn(name)} is not inside its own FSDP unit, so the whole model is "
                "unsharded during its recompute. Wrap with auto_wrap_policy that wraps each checkpointed block "
                "(or use distckpt.parallelize(model, 'fsdp'))."
            )


def mixed_precision_kwargs(dtype: torch.dtype) -> dict[str, Any]:
    """FSDP1's own mixed precision (parameters and buffers in ``dtype``, gradients reduced in fp32)."""
    from torch.distributed.fsdp import MixedPrecision

    return {"mixed_precision": MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=dtype)}


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """The total gradient norm over all ranks, clipped to ``max_norm``: FSDP1 shards flat parameters, so only its
    wrapper's ``clip_grad_norm_`` sees every shard."""
    return model.clip_grad_norm_(max_norm)
