"""Apply activation checkpointing to a model's blocks in place, keeping every parameter name: resolve the
policy (a planned one, such as ``budget``, plans on a profile), then give the chosen blocks the checkpointed
class (:mod:`distckpt.runtime.swap`, which keeps each block's object and FQN); what was decided stays on the
model as its :class:`~distckpt.apply.state.WrapState`, which :func:`hand_over` (called by ``parallelize``)
reads. ``checkpointed``, ``checkpointing_disabled``, ``unwrap``, ``is_checkpointed`` and ``checkpoint_mode``
are importable from here too.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.nn as nn

from distckpt import _torch_compat as compat
from distckpt._log import notify
from distckpt.apply.state import WRAP_STATE, WrapState, wrap_state
from distckpt.errors import ConfigError
from distckpt.layout import Layout
from distckpt.runtime.recompute import (
    CheckpointOptions,
    cache_positions,
    eager_reason,
    prepare_eager_run,
    stateful_norms,
)
from distckpt.runtime.selective import KEEP_MODE, OP_MODES, KeepOps, context_mode, keep_context_fn, mode_context_fn
from distckpt.runtime.swap import (
    _COMPILE,
    CHECKPOINT_MODES,
    _checkpointed_class,
    checkpoint_mode,
    checkpointed,
    checkpointing_disabled,
    is_checkpointed,
    unwrap,
)
from distckpt.select import (
    BlockSpec,
    Candidates,
    Parallelism,
    Policy,
    find_blocks,
    is_planned,
    parse_policy,
    select_blocks,
)

__all__ = [
    "checkpoint_mode",
    "checkpointed",
    "checkpointing_disabled",
    "hand_over",
    "is_checkpointed",
    "unwrap",
    "wrap",
]

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
        notify(
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
            the model (``budget``, any :class:`~distckpt.select.PlannedPolicy`). Without it, such a
            policy profiles the first training forward (grad enabled, ``model.training``) with that
            forward's inputs and chooses its blocks then, identically on every rank; under FSDP/FSDP2,
            which shard each block at ``parallelize`` time (a block's checkpointing cannot change
            after), pass it.

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
    _refuse_parallel(model)
    _foreign_checkpointing(model)
    compiled = model.__dict__.get(_COMPILE)  # compile_blocks ran before: compile again after this choice
    if compiled is not None:
        compiled.remove(model)

    candidates = find_blocks(model, blocks)
    replaced = unwrap(model, [m for _, m in candidates])
    if replaced:
        notify(f"distckpt.apply.wrap: replacing the earlier checkpointing of {replaced} blocks", warn=False)
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
    # Replaces an earlier call's state. FSDP/FSDP2 make every candidate block a unit, checkpointed or not.
    state = model.__dict__[WRAP_STATE] = WrapState(candidates, pol, example_inputs=example_inputs)
    if pol is None:
        if compiled is not None:
            compiled.apply(model)
        return model
    state.options = CheckpointOptions(reentrant, preserve_rng_state, offload, context_fn)
    if example_inputs is None and is_planned(pol):
        # No sample batch: profile on the first training forward, with its inputs.
        # Disabled for dynamo: under torch.compile(model) the plan (a profile of the model) runs eagerly, a graph
        # break before the first forward; traced, it crashed dynamo (measured, torch 2.13).
        state.pending = model.register_forward_pre_hook(
            torch.compiler.disable(_plan_on_first_forward), with_kwargs=True
        )
        return model
    _apply_plan(model, state)
    return model


def _world_size() -> int:
    from torch.distributed import get_world_size, is_initialized

    return get_world_size() if is_initialized() else 1


def _apply_plan(model: nn.Module, state: WrapState) -> None:
    """Choose the blocks (a planned policy: for the placement handed over, else for what it assumes) and
    give them the checkpointed class in their modes."""
    compiled = model.__dict__.get(_COMPILE)
    if compiled is not None:
        compiled.remove(model)  # a plan profiles the blocks uncompiled; compiled again below, in their new modes
    pol, opts, candidates = state.policy, state.options, state.candidates
    assert pol is not None and opts is not None  # internal invariant: wrap plans only a policy
    target = None
    if is_planned(pol):
        target = state.handed_over or pol.plans_for(Parallelism(None, _world_size()))
        pol = pol.placed(target) if state.handed_over is not None else pol
    world = target.world_size if target is not None else _world_size()
    found = Candidates(model, candidates, state.example_inputs, world, opts.preserve_rng_state, not opts.reentrant)
    modes = _block_modes(pol, found, opts)
    state.planned_for = target
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
    names = [str(m) for m in modes.values()]  # a KeepOps is the "ops" mode
    counts = ", ".join(f"{names.count(k)} {k}" for k in CHECKPOINT_MODES[1:] if k in names) or "none"
    logger.info(
        "distckpt.apply.wrap: policy %s checkpoints %d of %d blocks (%s)", pol, len(modes), len(candidates), counts
    )
    if compiled is not None:
        compiled.apply(model)


def _mode_context_fn(mode: str | KeepOps, opts: CheckpointOptions, made: dict[str, Any]) -> Any:
    """The ``context_fn`` a block checkpointed in ``mode`` runs under: none for full, its kept calls' for a
    :class:`KeepOps`, the policy's own for its own op-level mode (a ``Selective`` with its ops), else the
    named mode's (made once)."""
    if mode == "full":
        return None
    if isinstance(mode, KeepOps):
        return keep_context_fn(mode)
    if opts.context_fn is not None and context_mode(opts.context_fn) == mode:
        return opts.context_fn
    if mode not in made:
        made[mode] = mode_context_fn(mode)
    return made[mode]


def _block_modes(pol: Policy, candidates: Candidates, opts: CheckpointOptions) -> dict[int, str | KeepOps]:
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
    allowed = tuple(m for m in CHECKPOINT_MODES[1:] if m != KEEP_MODE)
    bad = {repr(m) for m in modes.values() if not isinstance(m, KeepOps) and m not in allowed}
    if bad:
        raise ConfigError(
            f"policy {pol} returned checkpoint modes {sorted(bad)}; each must be one of {allowed} or a KeepOps "
            "(leave a block out to keep it unchecked)."
        )
    op_level = sorted({str(m) for m in modes.values() if m in OP_MODES or isinstance(m, KeepOps)})
    if opts.reentrant and op_level:
        raise ConfigError(f"{' and '.join(op_level)} (op-level) checkpointing needs reentrant=False.")
    return modes


def hand_over(model: nn.Module, layout: Layout) -> None:
    """The hand-over point: ``parallelize`` (or an integration that builds DDP itself) says how the model
    will run. A planned policy (``budget``) planned, or still to be planned on the first forward, for
    another strategy, world size or shard size is planned again for this one; one that contradicts it
    (``Budget(strategy=...)``) is refused. Nothing happens for other policies or a model ``wrap`` never saw.

    Args:
        model: the model after ``distckpt.wrap``, before any DDP/FSDP unit exists.
        layout: how it runs: the strategy, data-parallel ranks and (HSDP) shard size count for the plan.

    Raises:
        ConfigError: the policy contradicts ``parallelism`` (see :meth:`~distckpt.select.PlannedPolicy.plans_for`).
    """
    state = wrap_state(model)
    if state is None or not is_planned(state.policy):
        return
    assert state.policy is not None  # for the type checker: is_planned(None) is False
    parallelism = Parallelism(layout.strategy, layout.world_size, layout.shard_size)
    state.policy.plans_for(parallelism)  # raises on a contradiction, before anything changes
    state.handed_over = parallelism
    if state.planned_for is None or state.planned_for == parallelism:
        return  # still to be planned (first forward: it will use these facts), or planned for them
    notify(
        f"distckpt budget: planned for {state.planned_for.strategy} over {state.planned_for.world_size} ranks at "
        f"wrap, redone for {parallelism.strategy} over {parallelism.world_size} ranks (parallelize's layout): the "
        "blocks checkpointed may change",
        warn=False,  # parallelize's documented hand-over, not a mistake: logged
    )
    unwrap(model, [m for _, m in state.candidates])
    _apply_plan(model, state)


def _plan_on_first_forward(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Forward pre-hook: plan on the first training forward's inputs, then go away."""
    if not (torch.is_grad_enabled() and model.training):
        return  # evaluation forwards say nothing about training memory
    _cancel_first_forward_plan(model)
    from distckpt.select.profile import Call

    state = wrap_state(model)
    assert state is not None  # internal invariant: the hook is the state's own
    state.example_inputs = Call(args, kwargs)
    _apply_plan(model, state)


def _cancel_first_forward_plan(model: nn.Module) -> None:
    state = wrap_state(model)
    if state is not None and state.pending is not None:
        state.pending.remove()
        state.pending = None
