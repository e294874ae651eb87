"""A ``Budget`` policy's plan on a model: the profile it plans on (a real sample step, or fake tensors for
``budget:auto``), the budget in bytes (``auto``: the CUDA device's free memory), whether and at what price
``offload`` is offered, and the program's choice (:func:`~distckpt.select.budget.program.plan_budget`),
logged once.
"""

from __future__ import annotations

import logging
import math

import torch

from distckpt.errors import ConfigError
from distckpt.layout import default_shard_size
from distckpt.runtime import recompute
from distckpt.select.budget.program import BudgetPlan, human_bytes, plan_budget
from distckpt.select.candidates import Candidates
from distckpt.select.profile import (
    RECOMPUTE_MODES,
    ModelProfile,
    batch_tensors,
    estimate_profile,
    flops_per_byte,
    step_device,
)

__all__ = ["auto_budget", "budget_profile", "offload_offered", "select_for_budget"]

logger = logging.getLogger("distckpt")


def auto_budget(device_type: str) -> int:
    """``budget:auto``: the free memory of the current CUDA device plus what this process already
    holds there (the model's parameters are part of the peak the budget bounds).

    Raises:
        ConfigError: off CUDA, where free memory says nothing useful.
    """
    if device_type != "cuda" or not torch.cuda.is_available():
        raise ConfigError(
            "budget:auto needs a CUDA device (it uses the device's free memory); on "
            f"{device_type} write an explicit size such as budget:8GiB."
        )
    free, _ = torch.cuda.mem_get_info()
    return int(free + torch.cuda.memory_allocated())


def offload_offered(device_type: str, offload_flops_per_byte: float | str | None) -> bool:
    """Whether a budget may choose ``"offload"``: only when asked for (a ratio, or ``"auto"`` to measure
    it; ``None``, the default until offload has been measured on a GPU, and ``math.inf``: not offered,
    no offload sample step, no pinned host memory for it), on CUDA; elsewhere host memory is the step's
    own, so only with a given ratio and a host store outside the step's allocator (a test's:
    :func:`distckpt.runtime.recompute.host_store`)."""
    if offload_flops_per_byte is None or (offload_flops_per_byte != "auto" and math.isinf(offload_flops_per_byte)):
        return False
    if device_type == "cuda":
        return True
    if offload_flops_per_byte == "auto":
        return False  # measured on CUDA only
    return bool(getattr(recompute.host_store(), "escapes_allocator", False))


def budget_profile(
    candidates: Candidates,
    device_type: str,
    budget_bytes: int | None,
    *,
    estimate: bool = False,
    selective: bool = True,
    offload: bool = False,
) -> tuple[ModelProfile, int]:
    """The profile a budget plans on, and the budget in bytes.

    ``budget:SIZE`` plans on a real sample step (:meth:`Candidates.model_profile`: exact on this
    step). ``budget:auto`` (``budget_bytes=None``) is for CUDA: the budget is the device's free memory plus
    what this process already holds there (:func:`auto_budget`), and the profile is the estimator of
    ``distckpt plan`` (:func:`distckpt.select.profile.estimate_profile`, fake tensors): a real step of a
    model near the device's size could run out of the very memory being planned. ``estimate=True``
    takes that path with an explicit budget (on any device). The real step measures only the recompute
    modes the plan can choose: full, and the op-level ones only with ``selective`` (two sample steps
    each; the profile cache serves the plan redone at ``parallelize`` from the same measurement), and
    ``"offload"`` only with ``offload`` (one more sample step).

    Raises:
        ConfigError: ``budget:auto`` off CUDA, or (estimator) a model that cannot run on fake tensors.
    """
    if budget_bytes is None:
        budget_bytes, estimate = auto_budget(device_type), True
    if not estimate:
        modes = (*(RECOMPUTE_MODES if selective else ("full",)), *(("offload",) if offload else ()))
        return candidates.model_profile(modes), budget_bytes
    if candidates.example_inputs is None:
        candidates.model_profile()  # raises: the policy needs a sample batch
    return estimate_profile(candidates.model, candidates.blocks, candidates.example_inputs), budget_bytes


def select_for_budget(
    candidates: Candidates,
    budget_bytes: int | None,
    *,
    strategy: str = "ddp",
    optimizer: str = "adamw",
    grad_accumulation: bool = False,
    shard_size: int | None = None,
    selective: bool = True,
    offload_flops_per_byte: float | str | None = None,
    per_op: bool = True,
) -> BudgetPlan:
    """The plan for ``budget:SIZE`` (``None``: ``budget:auto``): which blocks to checkpoint, and how.

    Args:
        candidates: the candidate blocks, the sample batch and the world size.
        budget_bytes: peak training memory not to exceed, in bytes; ``None`` for auto (CUDA).
        strategy: how parameters, gradients and optimizer state are placed: ``"ddp"`` (full
            replicas), ``"fsdp"``/``"fsdp2"`` (sharded by world size), ``"hsdp"`` (sharded by
            ``shard_size``, replicated across the groups) or ``"none"``.
        optimizer: ``"adamw"`` (default), ``"adam"``, ``"sgd"``, ``"sgd_momentum"`` or ``"none"``.
        grad_accumulation: gradients persist across micro-batches (count them all from the first
            forward); by default they are created block by block in backward.
        shard_size: ``"hsdp"``: the ranks that shard between them (default: ``LOCAL_WORLD_SIZE``, as
            ``parallelize`` uses).
        selective: offer the op-level modes (``pointwise``, ``selective``) per block, besides none and
            full (``False``: the profile does not measure them either).
        offload_flops_per_byte: the price of ``"offload"`` in FLOPs per byte moved; ``"auto"``: measured on
            CUDA (:func:`distckpt.select.profile.flops_per_byte`); ``None``: not offered; off CUDA offered
            only to tests (:func:`offload_offered`).
        per_op: with ``selective``, offer the ``"ops"`` mode too (which op calls' outputs a block keeps).

    Returns:
        A :class:`BudgetPlan` (``modes``: one of :data:`MODES` per block of ``candidates.blocks``).

    Raises:
        ConfigError: no sample batch, no placement fits, or ``budget:auto`` off CUDA.
    """
    batch = batch_tensors(candidates.example_inputs) if candidates.example_inputs is not None else []
    device = step_device(candidates.model, batch)
    offer = offload_offered(device.type, offload_flops_per_byte)
    mp, budget_bytes = budget_profile(candidates, device.type, budget_bytes, selective=selective, offload=offer)
    if offer and offload_flops_per_byte == "auto" and any(b.offload_held_bytes >= 0 for b in mp.blocks):
        dtype = next((p.dtype for p in candidates.model.parameters() if p.is_floating_point()), torch.float32)
        offload_flops_per_byte = flops_per_byte(mp, device, dtype)
    if strategy == "hsdp" and shard_size is None:
        shard_size = default_shard_size()
    result = plan_budget(
        mp,
        budget_bytes,
        strategy=strategy,
        world_size=candidates.world_size,
        optimizer=optimizer,
        grad_accumulation=grad_accumulation,
        shard_size=shard_size,
        selective=selective,
        offload_flops_per_byte=offload_flops_per_byte if offer and offload_flops_per_byte != "auto" else None,
        per_op=per_op,
    )
    logger.info(
        "distckpt budget %s: %d of %d blocks full, %d per-op, %d selective, %d pointwise, %d offloaded (%s moved "
        "per step), predicted peak %s, recompute %.3g GFLOP",
        human_bytes(budget_bytes),
        result.modes.count("full"),
        len(mp.blocks),
        result.modes.count("ops"),
        result.modes.count("selective"),
        result.modes.count("pointwise"),
        len(result.offloaded),
        human_bytes(result.moved_bytes),
        human_bytes(result.peak_bytes),
        result.recompute_flops / 1e9,
    )
    if result.offloaded:
        logger.info(
            "distckpt budget: offloaded blocks %s at %.3g FLOPs per byte",
            ", ".join(mp.blocks[i].fqn for i in result.offloaded),
            result.offload_flops_per_byte,
        )
    return result
