"""DeepSpeed ZeRO 1/2/3 made exact by distckpt: :func:`initialize` checkpoints the blocks, prepares ZeRO-3's units,
calls ``deepspeed.initialize`` and attaches distckpt's gradient-sync state to the engine it returns (:func:`attach`:
the zero-weight join of unused parameters, their gradients handed to ZeRO in one fixed order). HF Trainer's
``TrainingArguments(deepspeed=...)`` goes through :func:`prepare_trainer` (called by
``distckpt.integrations.hf.prepare``).

docs/integrations.md ("DeepSpeed") says what DeepSpeed gives without distckpt, measured, the order of the calls, and
the CPU setup.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import deepspeed
import torch
from torch import nn

import distckpt
from distckpt.errors import ConfigError
from distckpt.integrations._common import check_guard_every, checkpoint_blocks
from distckpt.integrations._zero import ZeroSyncState, skip_shm_build, zero_stage
from distckpt.options import check_graph
from distckpt.parallel.state import STATE_ATTR, sync_state
from distckpt.parallel.units import block_units, owners_of, reentrant_blocks, reentrant_params, root_unit
from distckpt.runtime.swap import _clean_fqn

__all__ = ["attach", "guard", "initialize", "install", "prepare_trainer", "skip_cpu_comm_build"]

_GUARD = "_distckpt_guard"  # attribute of the engine holding the GradSyncGuard of initialize(guard_every=N)
_UNITS = "_distckpt_zero3_units"  # attribute of the model: install prepared ZeRO-3's units (the block names)

_REENTRANT = (
    "reentrant checkpointing under DeepSpeed ZeRO: a reentrant block's nested backward hands its gradients to ZeRO in "
    "a pass of its own (measured without distckpt: two forwards fail with 'The parameter ... has already been "
    "reduced' under ZeRO-2 and an AssertionError in stage3.py under ZeRO-3; heads by rank train wrong or hang). Use "
    "distckpt.wrap(..., reentrant=False) (initialize's reentrant=False, the default)."
)


def initialize(
    model: nn.Module,
    *,
    policy: Any = "full",
    blocks: Any = None,
    reentrant: bool = False,
    graph: str = "auto",
    guard_every: int = 0,
    **kwargs: Any,
) -> tuple[Any, ...]:
    """``deepspeed.initialize`` for a model whose blocks distckpt checkpoints, exact for every multi-task pattern.

    The order (fixed): ``distckpt.wrap`` the blocks (:func:`install`; under ZeRO-3 also its units, see there), then
    ``deepspeed.initialize(model=model, **kwargs)``, then :func:`attach` on the engine. Train as usual with
    ``engine(batch)``, ``engine.backward(loss)``, ``engine.step()``.

    Args:
        model: the plain model (DeepSpeed has not seen it).
        policy: ``distckpt.wrap``'s policy (``"full"``, ``"every:2"``, ...); ``None`` keeps the model's own
            ``distckpt.wrap``.
        blocks: ``distckpt.wrap``'s ``blocks=``.
        reentrant: must be False (refused: ZeRO cannot reduce a reentrant block's gradients).
        graph: ``"auto"``: any pattern (unused parameters joined with zero gradients, reduced in one fixed order);
            ``"static"``: every rank uses the same parameters every step (DeepSpeed's own reduction, overlapped with
            backward; checked each step, a ConfigError otherwise).
        guard_every: ``GradSyncGuard.check()`` before every ``guard_every``-th optimizer step (0: never); see
            :func:`guard`.
        **kwargs: ``deepspeed.initialize``'s (``config=``, ``optimizer=``, ``model_parameters=``, ...).

    Returns:
        what ``deepspeed.initialize`` returns: ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    Raises:
        ConfigError: ``reentrant=True``, a model given twice (``model=`` in kwargs) or already a DeepSpeed engine, a
            bad ``graph``/``guard_every``, and what ``distckpt.wrap`` and :func:`attach` refuse.
    """
    check_graph(graph)
    check_guard_every(guard_every, "initialize")
    if "model" in kwargs:
        raise ConfigError("distckpt.integrations.deepspeed.initialize takes the model as its first argument only.")
    install(
        model,
        stage=_config_stage(kwargs.get("config", kwargs.get("config_params"))),
        policy=policy,
        blocks=blocks,
        reentrant=reentrant,
    )
    out = deepspeed.initialize(model=model, **kwargs)
    engine = out[0]
    attach(engine, graph=graph)
    if guard_every:
        _install_guard(engine, guard_every)
    return out


def install(model: nn.Module, *, stage: int | None, policy: Any = "full", blocks: Any = None, reentrant: bool = False):
    """What must happen before ``deepspeed.initialize``: checkpoint the blocks, and under ZeRO-3 choose its units.

    ZeRO-3 gathers a module's parameters in that module's forward, so a module some ranks do not run (a task head per
    rank) would pair its all-gather with another module's on the other ranks, and DeepSpeed's trace of the modules
    differs across ranks (its "Detected a disagreement on list contents"). So, as distckpt's FSDP units (the blocks
    and the root): every parameter outside the blocks is gathered by the root, in every rank's forward
    (``deepspeed.zero.register_external_parameter(model, p)``), and each subtree outside the blocks holding parameters
    is a DeepSpeed leaf module (``deepspeed.utils.set_z3_leaf_module``: no hooks below it). The blocks keep
    DeepSpeed's own per-module gathering.

    Args:
        model: the plain model.
        stage: the ZeRO stage of the config (None: unknown, nothing ZeRO-3 specific is done here;
            :func:`attach` refuses a ZeRO-3 engine without it).
        policy, blocks, reentrant: as :func:`initialize`.

    Raises:
        ConfigError: ``reentrant=True`` (or reentrant blocks already there), a model already a DeepSpeed engine, and
            what ``distckpt.wrap`` refuses.
    """
    if _is_engine(model):
        raise ConfigError(
            "distckpt.integrations.deepspeed got a DeepSpeed engine; pass the plain model, before deepspeed.initialize "
            "(or attach(engine) for an engine built from a model distckpt.wrap checkpointed)."
        )
    if reentrant:
        raise ConfigError(_REENTRANT)
    checkpoint_blocks(model, policy, blocks=blocks, reentrant=False, owner="initialize")
    if reentrant_blocks(model):
        raise ConfigError(_REENTRANT)
    if stage == 3 and _UNITS not in model.__dict__:
        block_names = _zero3_units(model)
        model.__dict__[_UNITS] = block_names


def attach(engine: Any, *, graph: str = "auto") -> ZeroSyncState:
    """Give a ``DeepSpeedEngine`` distckpt's gradient-sync state: the zero-weight join of unused parameters in the
    root's forward and, under ``graph='auto'``, the gradients handed to ZeRO in one fixed order at the end of each
    backward (ZeRO-2/3 reduce from hooks, in the order they fire, which differs across ranks when ranks use
    different parameters). Call it right after ``deepspeed.initialize``, before the first forward; :func:`initialize`
    does.

    Args:
        engine: the engine, built around a model whose blocks ``distckpt.wrap`` checkpointed (ZeRO-3: after
            :func:`install` on the model, before ``deepspeed.initialize``).
        graph: as :func:`initialize`'s.

    Returns:
        the state, also kept on the engine (``distckpt.parallel.state.sync_state(engine)``).

    Raises:
        ConfigError: not a ZeRO engine (stage 0: DeepSpeed's own DDP-like reduction, not supported), pipeline
            parallelism, the state attached twice, reentrant blocks, ZeRO-3 without :func:`install` first.
    """
    check_graph(graph)
    if not _is_engine(engine):
        raise ConfigError(f"attach takes a DeepSpeedEngine (deepspeed.initialize's first result), got {type(engine)}.")
    if sync_state(engine) is not None:
        raise ConfigError("this DeepSpeed engine already has distckpt's gradient-sync state; attach it once.")
    stage = zero_stage(engine)
    if stage == 0 or getattr(engine, "pipeline_parallelism", False):
        raise ConfigError(
            f"distckpt makes DeepSpeed's ZeRO stages 1, 2 and 3 exact; this engine runs "
            f"{'pipeline parallelism' if stage else 'ZeRO stage 0'}. Use zero_optimization.stage 1-3 in the config "
            "(or distckpt.parallelize(model, 'ddp') for plain data parallelism)."
        )
    model = engine.module
    if reentrant_blocks(model):
        raise ConfigError(_REENTRANT)
    if stage == 3 and _UNITS not in model.__dict__:
        raise ConfigError(
            "a ZeRO-3 engine whose model distckpt did not prepare: call distckpt.integrations.deepspeed.initialize "
            "(or install(model, stage=3) before deepspeed.initialize, then attach(engine))."
        )
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    owners = owners_of(model, names)
    if stage == 3:
        _, _, unit = block_units(model, names, owners)  # the root: the parameters outside the blocks
    else:
        unit = root_unit(model, names, owners)  # every parameter is whole on every rank
    by_name = {_clean_fqn(n): p for n, p in model.named_parameters()}
    state = ZeroSyncState(
        engine,
        names,
        [by_name[_clean_fqn(n)] for n in names],
        "static" if graph == "static" else "join",
        getattr(engine.optimizer, "dp_process_group", None),
        reentrant_params(model, names),
        static_check=graph == "static",
    )
    # prepend: the join runs before DeepSpeed's post-forward hook, which releases ZeRO-3's gathered parameters.
    state.attach(unit, prepend=True)
    setattr(engine, STATE_ATTR, state)
    return state


def guard(engine: Any) -> distckpt.GradSyncGuard | None:
    """The ``GradSyncGuard`` that ``initialize(guard_every=N)`` runs before the optimizer steps, or None."""
    return getattr(engine, _GUARD, None)


def prepare_trainer(trainer: Any, *, policy: Any, blocks: Any, reentrant: bool, graph: str, verify: bool) -> Any:
    """HF Trainer with ``TrainingArguments(deepspeed=...)``: :func:`install` on ``trainer.model`` now, and a callback
    that :func:`attach`-es the engine Trainer builds in ``train()`` (Accelerate's ``deepspeed.initialize``), before
    the first forward. Called by ``distckpt.integrations.hf.prepare`` with its ``DistckptCallback``'s options.

    Returns:
        the callback (a ``TrainerCallback``), to be placed before the ``DistckptCallback`` whose guard reads the
        state.

    Raises:
        ConfigError: ``reentrant=True``, ``verify=True`` (verify_recompute's extra backward would pass through ZeRO's
            reduction), and what :func:`install` refuses.
    """
    from transformers import TrainerCallback

    if verify:
        raise ConfigError(
            "DistckptCallback(verify=True) under DeepSpeed: verify_recompute's extra backward would pass through "
            "ZeRO's reduction. Run distckpt.verify_recompute on the plain model before Trainer(...), and verify=False."
        )
    plugin = trainer.accelerator.state.deepspeed_plugin
    stage = int(plugin.zero_stage) if plugin is not None else None
    install(trainer.model, stage=stage, policy=policy, blocks=blocks, reentrant=reentrant)

    class _AttachOnTrainBegin(TrainerCallback):
        """Attaches distckpt's state to the engine ``train()`` built, before its first forward."""

        def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001 - TrainerCallback's signature
            engine = trainer.model_wrapped
            if _is_engine(engine) and sync_state(engine) is None:
                attach(engine, graph=graph)

    return _AttachOnTrainBegin()


def skip_cpu_comm_build() -> None:
    """On CPU (``DS_ACCELERATOR=cpu``), skip the build of DeepSpeed's shared-memory all-reduce, which training does
    not use: 163 s at the first ``deepspeed.initialize`` on a 2-core machine, and a ``lock`` file left in
    ``~/.cache/torch_extensions`` by a rank killed meanwhile makes later runs wait forever. Call it before
    ``deepspeed.initialize`` (or ``deepspeed.init_distributed``) on every rank; after those it changes nothing.
    Without it, DeepSpeed builds the op once and reuses the cached build (docs/integrations.md, "DeepSpeed").
    """
    import deepspeed.ops

    skip_shm_build(deepspeed.ops)


# --- helpers -------------------------------------------------------------------------------------------------------


def _is_engine(obj: Any) -> bool:
    return isinstance(obj, deepspeed.DeepSpeedEngine)


def _config_stage(config: Any) -> int | None:
    """The ZeRO stage of a ``deepspeed.initialize`` config (a dict, or a JSON file path), or None."""
    if isinstance(config, str):
        import json

        with open(config) as f:
            config = json.load(f)
    if isinstance(config, Mapping):
        return int(config.get("zero_optimization", {}).get("stage", 0))
    return None


def _zero3_units(model: nn.Module) -> list[str]:
    """ZeRO-3's units (see :func:`install`): the root gathers every parameter outside the blocks, and each
    parameter-holding subtree outside the blocks is a leaf module. Returns the block names."""
    names = [n for n, p in model.named_parameters()]
    blocks, _, _ = block_units(model, names, owners_of(model, names))
    block_ids = {id(b) for _, b in blocks}
    ancestors = {id(m) for m in model.modules() if any(id(x) in block_ids for x in m.modules())}

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if id(child) in block_ids:
                continue
            if id(child) in ancestors:
                visit(child)
            elif any(True for _ in child.parameters()):
                deepspeed.utils.set_z3_leaf_module(child, True)

    visit(model)
    block_names = [bn for bn, _ in blocks]
    for n, p in model.named_parameters():
        if not any(n.startswith(bn + ".") for bn in block_names):
            # Registered before deepspeed.initialize: the root's fetch includes them from the first forward on.
            deepspeed.zero.register_external_parameter(model, p)
    return block_names


def _install_guard(engine: Any, every: int) -> None:
    """``GradSyncGuard.check()`` in a step pre-hook of the optimizer ZeRO steps (after DeepSpeed reduced, clipped and
    checked for overflow; a skipped fp16 step calls no hook on any rank)."""
    g = distckpt.GradSyncGuard(engine, every=every)
    setattr(engine, _GUARD, g)
    inner = getattr(engine.optimizer, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer):
        raise ConfigError(
            f"initialize(guard_every={every}): the engine's optimizer {type(engine.optimizer).__name__} wraps no torch "
            "optimizer to hook; use guard_every=0 and call distckpt.integrations.deepspeed.guard(engine).check() "
            "yourself."
        )

    def check(_opt: Any, _args: Any, _kwargs: Any) -> None:  # a step pre-hook returns None (or new arguments)
        g.check()

    inner.register_step_pre_hook(check)
