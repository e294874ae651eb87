"""Apply activation checkpointing to a model's blocks in place, keeping every parameter name: resolve the
policy (a ``budget`` plans on a profile), then give the chosen blocks the checkpointed class
(:mod:`distckpt.runtime.swap`, which keeps each block's object and FQN). ``checkpointed``,
``checkpointing_disabled``, ``unwrap``, ``is_checkpointed`` and ``checkpoint_mode`` are importable from here too.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import Any

import torch
import torch.nn as nn

from distckpt import _torch_compat as compat
from distckpt.errors import ConfigError
from distckpt.layout import Layout
from distckpt.runtime.recompute import (
    CheckpointOptions,
    cache_positions,
    eager_reason,
    prepare_eager_run,
    stateful_norms,
)
from distckpt.runtime.selective import OP_MODES, context_mode, mode_context_fn
from distckpt.runtime.swap import (
    _COMPILE,
    CHECKPOINT_MODES,
    _checkpointed_class,
    _clean_fqn,
    checkpoint_mode,
    checkpointed,
    checkpointing_disabled,
    is_checkpointed,
    unwrap,
)
from distckpt.select.blocks import BlockSpec, find_blocks
from distckpt.select.policies import Budget, Candidates, Policy, parse_policy, select_blocks

__all__ = ["checkpoint_mode", "checkpointed", "checkpointing_disabled", "is_checkpointed", "unwrap", "wrap"]

logger = logging.getLogger("distckpt")

# --- wrap ---------------------------------------------------------------------------------------


def parallel_kind(model: nn.Module) -> str | None:
    """``"DistributedDataParallel"`` or ``"FSDP"`` when ``model`` is already wrapped, else None."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return "DistributedDataParallel"
    try:
        from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch built without distributed
        return None
    if any(isinstance(m, (FullyShardedDataParallel, FSDPModule)) for m in model.modules()):
        return "FSDP"
    return None


def _refuse_parallel(model: nn.Module) -> None:
    kind = parallel_kind(model)
    if kind:
        raise ConfigError(
            f"distckpt.wrap got a model already wrapped in {kind}. Checkpointing must be applied to "
            "the blocks first: call distckpt.wrap(model) before distckpt.parallelize (or DDP/FSDP)."
        )


def _foreign_checkpointing(model: nn.Module) -> None:
    """Refuse or replace checkpointing applied by other tools, so no block is recomputed twice."""
    wrapped = [n for n, m in model.named_modules() if isinstance(m, compat.checkpoint_wrapper_class())]
    if wrapped:
        raise ConfigError(
            f"{type(model).__name__} already uses PyTorch's checkpoint_wrapper at {wrapped[0]}"
            f"{f' and {len(wrapped) - 1} more' if len(wrapped) > 1 else ''}; checkpointing it again would "
            "recompute those blocks twice. Remove apply_activation_checkpointing (distckpt.wrap "
            "replaces it and keeps parameter names), or skip distckpt.wrap."
        )
    composable = compat.composable_checkpoint_fqns(model)
    if composable:
        raise ConfigError(
            f"{type(model).__name__} already uses torch.distributed._composable.checkpoint at "
            f"{composable[0]}; remove it or skip distckpt.wrap, so no block is recomputed twice."
        )
    hf = [n for n, m in model.named_modules() if getattr(m, "gradient_checkpointing", False) is True]
    if hf:
        # transformers 5 renamed the switch; 4.x only has gradient_checkpointing_disable.
        disable = getattr(model, "activation_checkpointing_disable", None) or getattr(
            model, "gradient_checkpointing_disable", None
        )
        if disable is not None:
            disable()
        for _, m in model.named_modules():
            if getattr(m, "gradient_checkpointing", False) is True:
                m.gradient_checkpointing = False
            if getattr(m, "_require_grads_hook", None) is not None and hasattr(m, "disable_input_require_grads"):
                # HF (reentrant) and peft make the embeddings' output require grad with a hook; distckpt's
                # blocks need none, and it costs a backward through the embeddings (1.354x vs 1.329x FLOPs).
                m.disable_input_require_grads()
        warnings.warn(
            "distckpt.apply.wrap: the model had Hugging Face gradient checkpointing enabled "
            f"({len(hf)} modules); it was disabled so that no block is recomputed twice, and "
            "distckpt checkpoints the blocks instead.",
            stacklevel=3,
        )


def wrap(
    model: nn.Module,
    policy: str | Policy | None = "full",
    *,
    blocks: BlockSpec = None,
    reentrant: bool = False,
    preserve_rng_state: bool = True,
    offload: str | None = None,
    example_inputs: Any = None,
) -> nn.Module:
    """Checkpoint the blocks of ``model`` chosen by ``policy``, in place.

    Call it before :func:`distckpt.parallelize` (or DDP/FSDP). Parameter names and state_dict
    keys do not change. Calling it again replaces the earlier choice on the same blocks.

    Args:
        model: the model; its blocks are changed in place.
        policy: ``"none"``, ``"full"``, ``"every:N"``, ``"first:N"``, ``"fraction:F"``,
            ``"budget:SIZE"``, ``"selective"``, or a policy object.
        blocks: module classes, a predicate ``fn(module) -> bool``, FQN globs, or ``None`` to
            find the repeated blocks (logged on the ``distckpt`` logger).
        reentrant: use ``torch.utils.checkpoint``'s reentrant variant. Kept for users who ask for
            it; distckpt raises :class:`ConfigError` where it would be silently wrong.
        preserve_rng_state: recompute with the forward's RNG state (dropout stays exact).
        offload: ``"cpu"`` keeps the tensors saved at block boundaries in host memory
            (pinned on CUDA).
        example_inputs: a sample batch (tuple of args or dict of kwargs) for policies that profile
            the model (``budget``). Without it, ``budget`` profiles the first training forward
            (grad enabled, ``model.training``) with that forward's inputs and chooses its blocks
            then, identically on every rank; under FSDP/FSDP2, which shard each block at
            ``parallelize`` time (a block's checkpointing cannot change after), pass it.

    Returns:
        ``model``.

    Raises:
        ConfigError: bad policy or blocks, a model already wrapped in DDP/FSDP or in PyTorch's
            ``checkpoint_wrapper``, or options that cannot be combined.
    """
    pol = parse_policy(policy)
    if offload not in (None, "cpu"):
        raise ConfigError(f"offload must be None or 'cpu', got {offload!r}.")
    context_fn = getattr(pol, "context_fn", None)
    context_fn = context_fn() if context_fn is not None else None
    if reentrant and context_fn is not None:
        raise ConfigError("selective (op-level) checkpointing needs reentrant=False.")
    if reentrant and isinstance(pol, Budget) and pol.selective:
        pol = dataclasses.replace(pol, selective=False)  # reentrant checkpoint takes no op-level policy
    _refuse_parallel(model)
    _foreign_checkpointing(model)
    compiled = model.__dict__.get(_COMPILE)  # compile_blocks ran before: compile again after this choice
    if compiled is not None:
        compiled.remove(model)

    candidates = find_blocks(model, blocks)
    replaced = unwrap(model, [m for _, m in candidates])
    if replaced:
        logger.info("distckpt.apply.wrap: replacing the earlier checkpointing of %d blocks", replaced)
    for name, block in candidates:
        if "forward" in vars(block):
            raise ConfigError(
                f"{name} has a forward set on the instance (by accelerate hooks or a monkey patch); "
                "distckpt cannot checkpoint it without bypassing that forward. Remove the patch first."
            )
        outer = [
            n
            for n, m in model.named_modules()
            if is_checkpointed(m) and (name.startswith(n + ".") or n.startswith(name + "."))
        ]
        if outer:
            raise ConfigError(
                f"{name} is nested with the already checkpointed {outer[0]}: it would be recomputed "
                "twice. Choose blocks that do not contain each other."
            )
    _cancel_first_forward_plan(model)
    model.__dict__.pop(_BUDGET, None)
    # FSDP/FSDP2 make every candidate block a unit, checkpointed or not (parallelize reads this).
    model.__dict__[_BLOCKS] = tuple(m for _, m in candidates)
    if pol is None:
        if compiled is not None:
            compiled.apply(model)
        return model
    opts = CheckpointOptions(reentrant, preserve_rng_state, offload, context_fn)
    if isinstance(pol, Budget):
        # Kept so that parallelize can redo the plan for the strategy and mesh it really uses.
        model.__dict__[_BUDGET] = _BudgetRecord(pol, candidates, opts, example_inputs)
    if example_inputs is None and isinstance(pol, Budget):
        # No sample batch: profile on the first training forward, with its inputs.
        # Disabled for dynamo: under torch.compile(model) the plan (a profile of the model) runs eagerly, a graph
        # break before the first forward; traced, it crashed dynamo (measured, torch 2.13).
        handle = model.register_forward_pre_hook(torch.compiler.disable(_plan_on_first_forward), with_kwargs=True)
        model._distckpt_pending_plan = handle
        return model
    _apply_plan(model, pol, candidates, opts, example_inputs)
    return model


_BUDGET = "_distckpt_budget"  # the model's _BudgetRecord, when its policy is a Budget
_BLOCKS = "_distckpt_blocks"  # the candidate blocks wrap found (module references, not submodules)


def candidate_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks ``wrap`` chose among (checkpointed or not), in forward order; for a model ``wrap``
    never saw, the repeated blocks found automatically, or none when there are no such blocks."""
    recorded = model.__dict__.get(_BLOCKS)
    if recorded is None:
        try:
            return find_blocks(model)
        except ConfigError:
            return []
    mine = {id(m) for m in recorded}
    return [(_clean_fqn(n), m) for n, m in model.named_modules() if id(m) in mine]


@dataclasses.dataclass
class _BudgetRecord:
    """A budget policy as given, what it planned on, and the (strategy, world size, shard size) it
    planned for (``None`` until planned)."""

    policy: Budget
    candidates: list[tuple[str, nn.Module]]
    opts: CheckpointOptions
    example_inputs: Any
    planned_for: tuple[str, int, int | None] | None = None
    handed_over: tuple[str, int, int | None] | None = None  # set by parallelize


def _world_size() -> int:
    from torch.distributed import get_world_size, is_initialized

    return get_world_size() if is_initialized() else 1


def _apply_plan(
    model: nn.Module, pol: Policy, candidates: list[tuple[str, nn.Module]], opts: CheckpointOptions, example_inputs: Any
) -> None:
    compiled = model.__dict__.get(_COMPILE)
    if compiled is not None:
        compiled.remove(model)  # a plan profiles the blocks uncompiled; compiled again below, in their new modes
    record: _BudgetRecord | None = model.__dict__.get(_BUDGET)
    world = _world_size()
    if record is not None and record.handed_over is not None:
        strategy, world, shard_size = record.handed_over
        pol = dataclasses.replace(record.policy, strategy=strategy, shard_size=shard_size)
    modes = _block_modes(pol, Candidates(model, candidates, example_inputs, world, opts.preserve_rng_state), opts)
    if record is not None and isinstance(pol, Budget):
        record.planned_for = (pol.strategy_for(world), world, pol.shard_size)
    made: dict[str, Any] = {}  # one context_fn per op-level mode, shared by its blocks
    for i, mode in sorted(modes.items()):
        block = candidates[i][1]
        block.__class__ = _checkpointed_class(type(block))
        # An offloaded block runs no checkpoint at all: neither reentrant nor op-level options apply to it.
        block._distckpt_options = (
            dataclasses.replace(opts, context_fn=None, recompute=False, reentrant=False)
            if mode == "offload"
            else dataclasses.replace(opts, context_fn=_mode_context_fn(mode, opts, made))
        )
        block._distckpt_norms = stateful_norms(block)  # found once, not on every forward
        block._distckpt_cache_slots = cache_positions(type(block)._distckpt_orig_class)
        if eager_reason(block):
            prepare_eager_run()
    counts = (
        ", ".join(f"{sum(m == k for m in modes.values())} {k}" for k in CHECKPOINT_MODES[1:] if k in modes.values())
        or "none"
    )
    logger.info(
        "distckpt.apply.wrap: policy %s checkpoints %d of %d blocks (%s)", pol, len(modes), len(candidates), counts
    )
    if compiled is not None:
        compiled.apply(model)


def _mode_context_fn(mode: str, opts: CheckpointOptions, made: dict[str, Any]) -> Any:
    """The ``context_fn`` a block checkpointed in ``mode`` runs under: none for full, the policy's own
    for its own op-level mode (a ``Selective`` with its ops), else the named mode's (made once)."""
    if mode == "full":
        return None
    if opts.context_fn is not None and context_mode(opts.context_fn) == mode:
        return opts.context_fn
    if mode not in made:
        made[mode] = mode_context_fn(mode)
    return made[mode]


def _block_modes(pol: Policy, candidates: Candidates, opts: CheckpointOptions) -> dict[int, str]:
    """``{index: mode}`` for the blocks ``pol`` checkpoints: its ``modes`` when it has them (a budget
    plan, a placement), else its selection, all in the policy's own mode.

    Raises:
        ConfigError: a mode that is not a checkpointing one, or an op-level mode with reentrant checkpointing.
    """
    if not callable(getattr(pol, "modes", None)):
        own = context_mode(opts.context_fn) if opts.context_fn else "full"
        return dict.fromkeys(select_blocks(pol, candidates), own)
    modes = dict(pol.modes(candidates))
    assert all(0 <= i < len(candidates.blocks) for i in modes), modes  # internal invariant
    allowed = CHECKPOINT_MODES[1:]
    bad = {m for m in modes.values() if m not in allowed}
    if bad:
        raise ConfigError(
            f"policy {pol} returned checkpoint modes {sorted(bad)}; each must be one of {allowed} "
            "(leave a block out to keep it unchecked)."
        )
    op_level = sorted({m for m in modes.values() if m in OP_MODES})
    if opts.reentrant and op_level:
        raise ConfigError(f"{' and '.join(op_level)} (op-level) checkpointing needs reentrant=False.")
    return modes


def replan_budget(model: nn.Module, layout: Layout) -> None:
    """The hand-over point: ``parallelize`` says how the model will run. A budget planned (or still
    to be planned on the first forward) for another strategy, world size or shard size is redone for
    this ``layout``; one whose explicit ``strategy``/``shard_size`` contradicts it is refused.

    Raises:
        ConfigError: ``Budget(strategy=...)`` or ``Budget(shard_size=...)`` other than what
            ``parallelize`` uses.
    """
    record: _BudgetRecord | None = model.__dict__.get(_BUDGET)
    if record is None:
        return
    pol = record.policy
    strategy, world_size, shard_size = layout.strategy, layout.world_size, layout.shard_size
    # FSDP2 over a 2-D mesh is HSDP: a plan for "fsdp2" is redone for its shard groups, not refused.
    if pol.strategy is not None and pol.strategy != strategy and (pol.strategy, strategy) != ("fsdp2", "hsdp"):
        raise ConfigError(
            f"distckpt.wrap(model, Budget(..., strategy={pol.strategy!r})) planned memory for {pol.strategy}, but "
            f"parallelize uses {strategy!r} (which places parameters, gradients and optimizer state differently). "
            f"Pass strategy={strategy!r} to Budget, or leave it out (as budget:SIZE does) so the plan follows "
            "parallelize."
        )
    if pol.shard_size is not None and shard_size is not None and pol.shard_size != shard_size:
        raise ConfigError(
            f"Budget(shard_size={pol.shard_size}) planned for shard groups of {pol.shard_size} ranks, but parallelize "
            f"shards over {shard_size}. Pass the same shard_size to both, or leave it out of Budget."
        )
    facts = (strategy, world_size, shard_size)
    record.handed_over = facts
    if record.planned_for is None or record.planned_for == facts:
        return  # still to be planned (first forward: it will use these facts), or planned for them
    logger.info(
        "distckpt budget: planned for %s over %d ranks at wrap, redone for %s over %d ranks",
        record.planned_for[0],
        record.planned_for[1],
        strategy,
        world_size,
    )
    unwrap(model, [m for _, m in record.candidates])
    _apply_plan(model, pol, record.candidates, record.opts, record.example_inputs)


def _plan_on_first_forward(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Forward pre-hook: plan a budget on the first training forward's inputs, then go away."""
    if not (torch.is_grad_enabled() and model.training):
        return  # evaluation forwards say nothing about training memory
    _cancel_first_forward_plan(model)
    from distckpt.select.profile import Call

    record: _BudgetRecord = model.__dict__[_BUDGET]
    record.example_inputs = Call(args, kwargs)
    _apply_plan(model, record.policy, record.candidates, record.opts, record.example_inputs)


def _cancel_first_forward_plan(model: nn.Module) -> None:
    handle = model.__dict__.pop("_distckpt_pending_plan", None)
    if handle is not None:
        handle.remove()


def pending_plan(model: nn.Module) -> bool:
    """Whether a ``budget`` policy still waits for the first training forward to choose its blocks."""
    return "_distckpt_pending_plan" in model.__dict__
