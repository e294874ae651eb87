"""Hugging Face ``Trainer`` with distckpt: ``DistckptCallback`` (the options, ``GradSyncGuard`` before each optimizer
step, the verdict in Trainer's logs, ``verify_recompute`` once) and ``prepare(trainer)``, which hands the DDP that
Trainer builds to distckpt (``distckpt.integrations.accelerate.install``) before ``trainer.train()``.

Why ``prepare(trainer)`` and not the callback alone: Trainer builds its ``Accelerator`` (with the DDP flags) in
``__init__`` and DDP in ``train()``, and no callback event receives the Trainer or its accelerator, so a callback
cannot reach either. docs/integrations.md ("Hugging Face Trainer", "TRL") says what holds, measured; TRL's trainers
are Trainer subclasses: ``with_distckpt(DPOTrainer)``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

import distckpt
from distckpt.errors import ConfigError
from distckpt.integrations._common import check_guard_every
from distckpt.integrations.accelerate import forget, install
from distckpt.options import Engine, accumulate_refusal, check_graph

__all__ = ["DistckptCallback", "DistckptTrainer", "prepare", "with_distckpt"]

logger = logging.getLogger(__name__)

_PREPARE = "distckpt.integrations.hf.prepare(trainer)"


class DistckptCallback(TrainerCallback):
    """distckpt's checkpointing and gradient checks inside ``Trainer.train``; pair it with :func:`prepare`.

    ``Trainer(callbacks=[DistckptCallback(...)])`` alone cannot change the DDP that Trainer builds; call
    ``distckpt.integrations.hf.prepare(trainer)`` after ``Trainer(...)`` and before ``trainer.train()`` (or use
    :class:`DistckptTrainer`). ``train()`` refuses to start otherwise.

    Args:
        policy: ``distckpt.wrap``'s policy for the model's blocks (``"full"``, ``"every:2"``, ``"budget:2GiB"``,
            ...); ``None`` keeps the checkpointing the model already has from ``distckpt.wrap``.
        guard_every: run ``GradSyncGuard.check()`` before every ``guard_every``-th optimizer step (after gradient
            clipping, before ``optimizer.step()``; 0: never). A desync raises ``GradDesyncError`` on every rank,
            naming the parameter, and ends ``train()``. Each log line carries ``distckpt_guard_checks`` (steps
            checked since the previous log, all in sync) and ``distckpt_guard_grad_norm``.
        verify: run ``distckpt.verify_recompute`` once, on the first training batch, before its step (raises
            ``RecomputeMismatchError`` naming the module whose recompute differs).
        blocks: ``distckpt.wrap``'s ``blocks=`` (``None``: found in the model, e.g. ``transformer.h.*``).
        reentrant: ``distckpt.wrap``'s ``reentrant=`` (DDP then runs with ``static_graph=True``: no gradient
            accumulation).
        graph: ``distckpt.parallelize``'s ``graph=`` (``"auto"``: any pattern; ``"static"``: the same parameters
            every step).

    Raises:
        ConfigError: bad options; at ``Trainer(...)``: HF's checkpointing turned on by the user alongside
            (``activation_checkpointing=True`` in ``TrainingArguments``; a TRL config's default ``True`` is turned
            off instead, logged on rank 0); at ``train()``: :func:`prepare` was not called.
    """

    def __init__(
        self,
        policy: Any = "full",
        guard_every: int = 0,
        verify: bool = False,
        *,
        blocks: Any = None,
        reentrant: bool = False,
        graph: str = "auto",
    ) -> None:
        check_guard_every(guard_every, "DistckptCallback")
        check_graph(graph)
        self.policy, self.guard_every, self.verify = policy, guard_every, bool(verify)
        self.blocks, self.reentrant, self.graph = blocks, reentrant, graph
        self.prepared = False
        self.guard: distckpt.GradSyncGuard | None = None
        self._trainer: Trainer | None = None
        self._model: torch.nn.Module | None = None  # the model prepare installed distckpt for (model_init: the last)
        self._checks = 0  # guard checks since the last log
        self._last: Any = None  # the last GuardReport

    # --- Trainer events ------------------------------------------------------------------------------------------

    def on_init_end(self, args, state, control, **kwargs):  # noqa: ANN001 - TrainerCallback's signature
        _take_over_hf_checkpointing(args)

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001
        if not self.prepared:
            raise ConfigError(
                "DistckptCallback is in Trainer's callbacks but the Trainer was not prepared, so its DDP runs without "
                f"distckpt (Trainer's find_unused_parameters, no zero-weight join). Call {_PREPARE} after Trainer(...) "
                "and before trainer.train(), or use distckpt.integrations.hf.DistckptTrainer."
            )
        self.guard = None
        trainer = self._trainer
        if self.guard_every and trainer is not None:
            self.guard = distckpt.GradSyncGuard(trainer.model_wrapped, every=self.guard_every)
        self._checks, self._last = 0, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):  # noqa: ANN001
        # After backward and clipping, before optimizer.step(): every rank calls it once per optimizer step.
        if self.guard is None:
            return
        report = self.guard.check()  # GradDesyncError on every rank: train() ends, no rank waits
        if report.grads_checked:
            self._checks += 1
            self._last = report

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001
        if self.guard is None or not logs or "loss" not in logs:  # a training step's log line only
            return
        verdict: dict[str, float] = {"distckpt_guard_checks": self._checks}
        if self._last is not None and self._last.grad_norm is not None:
            verdict["distckpt_guard_grad_norm"] = round(float(self._last.grad_norm), 6)
        logs.update(verdict)
        if state.log_history:  # Trainer appended its copy of these logs before this event: the same in both
            state.log_history[-1].update(verdict)
        self._checks = 0

    def on_train_end(self, args, state, control, **kwargs):  # noqa: ANN001
        self.guard = None


def _hf_name(args: Any) -> str:
    """The ``TrainingArguments`` name of HF's checkpointing in this transformers: ``activation_checkpointing`` (5.25
    renamed it; ``gradient_checkpointing`` warns there and goes in v6), ``gradient_checkpointing`` before."""
    names = {f.name for f in dataclasses.fields(args)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def _on_by_default(args: Any) -> bool:
    """Whether the arguments' class turns HF's checkpointing on by default: every TRL config (DPO, SFT, GRPO, KTO,
    RLOO, Reward) declares ``gradient_checkpointing=True``; ``TrainingArguments`` declares it off."""
    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    return any(defaults.get(n) is True for n in ("activation_checkpointing", "gradient_checkpointing"))


def _take_over_hf_checkpointing(args: Any) -> None:
    """HF's checkpointing in ``args`` alongside ``DistckptCallback``: turned off (logged on rank 0) when it is the
    arguments' class default (TRL's configs), refused when the user turned it on (``TrainingArguments``' default is
    off). docs/integrations.md ("TRL") says why."""
    if not (getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False)):
        return
    name = _hf_name(args)
    if not _on_by_default(args):
        raise ConfigError(
            f"TrainingArguments({name}=True) and DistckptCallback would checkpoint the blocks twice, and HF's "
            "checkpointing is not kept in sync under DDP (reentrant: 'Expected to mark a variable ready only once'). "
            f"Pass {name}=False (TrainingArguments or any TRL config): DistckptCallback checkpoints the blocks "
            "(policy=, reentrant=)."
        )
    for n in ("activation_checkpointing", "gradient_checkpointing"):
        if hasattr(args, n):  # 5.25 keeps both names in step; older versions have the second only
            setattr(args, n, False)
    if getattr(args, "process_index", 0) == 0:
        logger.warning(
            "%s turns HF's checkpointing on by default (%s=True); DistckptCallback checkpoints the blocks instead, so "
            "distckpt turned HF's off. Pass %s=False to say so and silence this line.",
            type(args).__name__,
            name,
            name,
        )


def _refuse_hf_model_checkpointing(model: torch.nn.Module) -> None:
    # transformers 5.25: is_activation_checkpointing (is_gradient_checkpointing is deprecated, warns); 4.x: the latter.
    new = hasattr(model, "is_activation_checkpointing")
    if getattr(model, "is_activation_checkpointing" if new else "is_gradient_checkpointing", False):
        off = "activation_checkpointing_disable" if new else "gradient_checkpointing_disable"
        raise ConfigError(
            f"the model has Hugging Face's own checkpointing on (model.{off.replace('disable', 'enable')}()), which "
            f"DistckptCallback would double and which is not kept in sync under DDP. Call model.{off}() before "
            "Trainer(...): DistckptCallback checkpoints the blocks."
        )


def _callback(trainer: Trainer) -> DistckptCallback:
    found = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, DistckptCallback)]
    if len(found) > 1:
        raise ConfigError(
            f"the Trainer has {len(found)} DistckptCallbacks; keep one (each would checkpoint and check the model)."
        )
    if found:
        return found[0]
    cb = DistckptCallback()
    trainer.add_callback(cb)
    return cb


def prepare(trainer: Trainer) -> Trainer:
    """Hand the DDP that ``trainer.train()`` builds to distckpt: checkpoint the blocks with distckpt, DDP's flags
    from distckpt (``find_unused_parameters=False``), distckpt's zero-weight join and used-set checks in every
    forward, gradient accumulation without sync, ``GradSyncGuard`` before the optimizer steps.

    Call it once, after ``Trainer(...)`` and before ``trainer.train()``. The options are those of the
    ``DistckptCallback`` in ``trainer``'s callbacks (one with the defaults is added when there is none). With
    ``Trainer(model_init=...)`` (and ``hyperparameter_search``), ``train()`` builds a new model (and, per trial, a new
    accelerator): distckpt checkpoints and takes over each of them, so the model ``train()`` trains is the one made
    exact.

    Args:
        trainer: a ``transformers.Trainer`` (or subclass, e.g. TRL's ``DPOTrainer``) not trained yet.

    Returns:
        ``trainer``.

    Raises:
        ConfigError: HF's checkpointing turned on by the user (``activation_checkpointing=True`` in
            ``TrainingArguments``; a TRL config's default is taken over instead), ``ddp_find_unused_parameters=True``
            or ``ddp_static_graph`` against distckpt's choice, gradient accumulation with reentrant blocks or
            ``graph='static'``, FSDP (Accelerate's own sharding), a model Trainer already prepared, and what
            ``distckpt.wrap`` refuses; under ``TrainingArguments(deepspeed=...)``, ``model_init`` and what
            ``distckpt.integrations.deepspeed.prepare_trainer`` refuses.
    """
    cb = _callback(trainer)
    if cb.prepared:
        raise ConfigError(f"{_PREPARE} was already called for this Trainer; call it once, before trainer.train().")
    if trainer.is_deepspeed_enabled:
        return _prepare_deepspeed(trainer, cb)
    _check_args(trainer, cb)
    _install(trainer, cb, trainer.model, cb.policy)
    if trainer.model_init is not None:
        _follow_model_init(trainer, cb)
    # First among the callbacks: its on_log adds the guard's verdict before the printers and reporters read the logs.
    handler_cbs = trainer.callback_handler.callbacks
    handler_cbs.remove(cb)
    handler_cbs.insert(0, cb)
    if cb.verify:
        _verify_on_first_batch(trainer)
    cb._trainer = trainer
    cb.prepared = True
    return trainer


def _check_args(trainer: Trainer, cb: DistckptCallback) -> None:
    """Refuse the ``TrainingArguments`` distckpt cannot keep exact (see :func:`prepare`'s Raises)."""
    args = trainer.args
    _take_over_hf_checkpointing(args)
    if args.fsdp or trainer.is_fsdp_enabled:
        # Refused on CPU too, where Accelerate runs plain DDP instead of the FSDP asked for (measured: fsdp_config
        # version 2 -> DistributedType.MULTI_CPU; version 1 -> "sync_module_states=True is not supported on cpu").
        raise ConfigError(
            "TrainingArguments(fsdp=...): Accelerate shards the model in units distckpt does not choose, so its "
            "zero-weight join and checks cannot run inside them. Drop it and train with DDP (this prepare), or build "
            "FSDP/FSDP2 with distckpt.parallelize in your own loop or Lightning's DistckptFSDPStrategy."
        )
    if args.ddp_find_unused_parameters:
        raise ConfigError(
            "TrainingArguments(ddp_find_unused_parameters=True) is not needed with distckpt (unused parameters join "
            "the graph with weight zero in every forward) and breaks two forwards before one backward and reentrant "
            "checkpointing. Drop it (distckpt sets False)."
        )
    static = cb.reentrant or cb.graph == "static"
    if args.ddp_static_graph is not None and bool(args.ddp_static_graph) != static:
        raise ConfigError(
            f"TrainingArguments(ddp_static_graph={args.ddp_static_graph}) contradicts DistckptCallback(reentrant="
            f"{cb.reentrant}, graph={cb.graph!r}), which {'needs' if static else 'does not allow'} DDP's static graph. "
            "Drop ddp_static_graph: distckpt sets it."
        )
    if args.gradient_accumulation_steps > 1 and static:
        why = accumulate_refusal(Engine.DDP, reentrant=cb.reentrant, graph=cb.graph)
        raise ConfigError(
            f"TrainingArguments(gradient_accumulation_steps={args.gradient_accumulation_steps}): {why} "
            "(DistckptCallback(reentrant=False) is the default)."
        )
    if cb.verify and args.world_size > 1 and cb.reentrant:
        raise ConfigError(
            "DistckptCallback(verify=True) with reentrant=True: verify_recompute runs extra forwards and backwards "
            "through a DDP with static_graph=True, which DDP counts as training steps. Use verify=False, or "
            "reentrant=False."
        )


def _install(trainer: Trainer, cb: DistckptCallback, model: torch.nn.Module, policy: Any) -> None:
    """Checkpoint ``model``'s blocks (``policy``; None: as they are) and install distckpt on the Trainer's
    accelerator for it, forgetting any model installed there before (a model ``model_init`` replaced)."""
    _refuse_hf_model_checkpointing(model)
    handler = trainer.accelerator.ddp_handler
    if trainer.args.ddp_find_unused_parameters is None and handler is not None:
        # Trainer's default (True unless HF's checkpointing is on), not the user's choice: distckpt's flag instead.
        handler.find_unused_parameters = False
    if cb._model is not None and cb._model is not model:
        forget(trainer.accelerator, cb._model)  # the model model_init replaced
    cb._model = model
    install(
        trainer.accelerator,
        model,
        policy=policy,
        blocks=cb.blocks,
        reentrant=cb.reentrant,
        graph=cb.graph,
        guard_every=0,  # the callback runs the guard, to log its verdict
    )


def _follow_model_init(trainer: Trainer, cb: DistckptCallback) -> None:
    """``train()`` calls ``model_init`` again and trains that new model; ``hyperparameter_search`` also builds a new
    accelerator per trial (``create_accelerator_and_postprocess``, after the model). Both are public Trainer methods,
    called as ``self.<method>``: attributes on this Trainer shadow them, so each new model is checkpointed and each
    new accelerator builds distckpt's DDP, before ``train()`` prepares them."""
    call_model_init = trainer.call_model_init
    create_accelerator = trainer.create_accelerator_and_postprocess

    def model_init(trial: Any = None) -> torch.nn.Module:
        model = call_model_init(trial)
        _install(trainer, cb, model, cb.policy)
        return model

    def accelerator() -> None:
        create_accelerator()
        _check_args(trainer, cb)  # a trial may have changed the arguments
        _install(trainer, cb, trainer.model, None)  # already checkpointed by model_init above

    trainer.call_model_init = model_init  # type: ignore[method-assign]
    trainer.create_accelerator_and_postprocess = accelerator  # type: ignore[method-assign]


def _prepare_deepspeed(trainer: Trainer, cb: DistckptCallback) -> Trainer:
    """``TrainingArguments(deepspeed=...)``: distckpt.integrations.deepspeed checkpoints the blocks now and attaches
    its state to the engine ``train()`` builds; the callback's guard then runs on that engine."""
    from distckpt.integrations.deepspeed import prepare_trainer

    _take_over_hf_checkpointing(trainer.args)
    _refuse_hf_model_checkpointing(trainer.model)
    if trainer.model_init is not None:
        # train() would build a new model from model_init after the blocks of this one were checkpointed.
        raise ConfigError(
            "Trainer(model_init=...) with TrainingArguments(deepspeed=...): train() builds a new model that distckpt "
            "has not prepared for ZeRO. Pass model=... instead (DDP through this prepare supports model_init)."
        )
    attach = prepare_trainer(
        trainer, policy=cb.policy, blocks=cb.blocks, reentrant=cb.reentrant, graph=cb.graph, verify=cb.verify
    )
    handler_cbs = trainer.callback_handler.callbacks
    handler_cbs.remove(cb)
    handler_cbs[:0] = [attach, cb]  # the state is attached before the callback builds its guard on the engine
    cb._trainer = trainer
    cb.prepared = True
    return trainer


def _verify_on_first_batch(trainer: Trainer) -> None:
    """``verify_recompute`` on the first training batch, through the Trainer's own ``compute_loss``, before that
    batch's step (it restores RNG states, buffers and gradients, so the step itself is unchanged)."""
    compute_loss: Callable[..., Any] = trainer.compute_loss

    def first(model: torch.nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        del trainer.compute_loss  # the class's method again from the next call on
        if model.training:

            def loss_fn(m: torch.nn.Module) -> torch.Tensor:
                out = compute_loss(m, inputs, *args, **kwargs)
                return out[0] if isinstance(out, tuple) else out

            report = distckpt.verify_recompute(model, loss_fn)
            logger.info("distckpt.verify_recompute on the first batch: %s", report)
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.compute_loss = first  # type: ignore[method-assign]


class DistckptTrainer(Trainer):
    """``Trainer`` that calls :func:`prepare` at the end of ``__init__``: pass ``DistckptCallback(...)`` in
    ``callbacks`` for the options (the defaults otherwise). For a Trainer subclass (TRL's ``DPOTrainer``,
    ``SFTTrainer``, ``GRPOTrainer``, ...) use :func:`with_distckpt`, or put this class first among the bases:
    ``class MyDPO(DistckptTrainer, DPOTrainer)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        prepare(self)


_MADE: dict[type, type] = {}  # with_distckpt's classes, one per trainer class


def with_distckpt(trainer_cls: type[Trainer]) -> type[Trainer]:
    """``trainer_cls`` (a ``Trainer`` subclass such as ``trl.DPOTrainer``) that calls :func:`prepare` at the end of
    its ``__init__``: ``class Distckpt<Name>(DistckptTrainer, trainer_cls)``, made once per class.

    ``with_distckpt(DPOTrainer)(model=..., args=DPOConfig(...), callbacks=[DistckptCallback(...)], ...)`` runs
    TRL's own ``__init__`` (reference model, peft, datasets) and then hands the DDP that ``train()`` builds to
    distckpt. TRL's configs turn HF's checkpointing on by default: distckpt turns it off, logged (docs/integrations.md,
    "TRL").

    Args:
        trainer_cls: ``transformers.Trainer`` or a subclass of it.

    Returns:
        the subclass (``trainer_cls`` itself if it already derives from :class:`DistckptTrainer`).

    Raises:
        ConfigError: ``trainer_cls`` is not a ``transformers.Trainer`` subclass.
    """
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, Trainer)):
        raise ConfigError(
            f"with_distckpt({trainer_cls!r}): pass a transformers.Trainer subclass (e.g. trl.DPOTrainer), not an "
            "instance; for a Trainer already built call distckpt.integrations.hf.prepare(trainer)."
        )
    if issubclass(trainer_cls, DistckptTrainer):
        return trainer_cls
    if trainer_cls not in _MADE:
        name = f"Distckpt{trainer_cls.__name__}"
        doc = f"``{trainer_cls.__module__}.{trainer_cls.__qualname__}`` prepared by distckpt (with_distckpt)."
        _MADE[trainer_cls] = type(name, (DistckptTrainer, trainer_cls), {"__doc__": doc, "__module__": __name__})
    return _MADE[trainer_cls]
