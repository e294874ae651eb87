"""A training loop written as a DeepSpeed user writes it (``engine(batch)``, ``engine.backward(loss)``,
``engine.step()``), on the ranks of a test pool: each pattern of tests/patterns.py under ZeRO 1/2/3 on CPU
(``DS_ACCELERATOR=cpu``, gloo), its per-step full gradients and final parameters, for
tests/integrations/test_deepspeed.py.

DeepSpeed stays in the processes of its own pool (the test module's fixture): ZeRO-3 replaces
``torch.nn.functional.linear`` for the whole process, and its communication backend outlives an engine.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from patterns import PATTERNS, TASKS, Pattern, _mse, build, make_optimizer, micro_batches
from patterns import reference as plain_reference

import distckpt
from distckpt.integrations._zero import zero_stage

STEPS = 3
GLOBAL_BATCH = 8


def order_by_rank(model, x, step, rank):
    # Every rank uses every head, in another order: ZeRO-2's hooks fire in another order on each rank.
    tasks = TASKS if rank % 2 == 0 else TASKS[::-1]
    out = model(x, tasks)
    return sum(_mse(out[t], x) for t in tasks)


# Patterns of this suite only (ZeRO's own failure modes), beside tests/patterns.py's.
EXTRA = {"order_by_rank": Pattern("order_by_rank", order_by_rank, {}, static=True)}


def pattern_of(name: str) -> Pattern:
    return EXTRA.get(name) or PATTERNS[name]


def setup() -> None:
    """On a rank, before DeepSpeed is imported: the CPU accelerator, and no build of its shared-memory op."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    from distckpt.integrations import deepspeed as dc_deepspeed

    dc_deepspeed.skip_cpu_comm_build()


def offload(stage: int, **options: Any) -> dict[str, Any]:
    """ZeRO-Offload's ``zero_optimization`` entries: the optimizer state and step on the CPU (stages 1-3), and under
    ZeRO-3 the parameters too; ``options`` go to both (``pin_memory``, ...)."""
    cpu = {"device": "cpu", **options}
    return {"offload_optimizer": cpu, **({"offload_param": dict(cpu)} if stage == 3 else {})}


def config(stage: int, world: int, micro_batches: int = 1, **zero: Any) -> dict[str, Any]:
    """A ZeRO config for the patterns' batches. ``gradient_clipping`` is 0: DeepSpeed 0.19's default clips at 1.0,
    which a plain AdamW reference does not (and whose norm DeepSpeed computes over its flat partitions: float32
    rounding that Adam amplifies). ``stage3_param_persistence_threshold`` 0: the tiny parameters are partitioned too
    (by default ZeRO-3 keeps parameters under 1e5 elements whole on every rank). ``zero_force_ds_cpu_optimizer``
    false: with ``offload_optimizer`` (:func:`offload`) DeepSpeed otherwise refuses a client torch optimizer (it wants
    its ``DeepSpeedCPUAdam``, a C++ op built on first use); without offload the flag changes nothing."""
    return {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": micro_batches,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "zero_force_ds_cpu_optimizer": False,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
    }


def reference(pattern: Pattern, world: int, steps: int = STEPS) -> tuple[list[dict], dict]:
    """tests/patterns.py's single-process reference (no checkpointing, the global batch, AdamW) with DeepSpeed's
    rule for a parameter no rank used in a step: a zero gradient (ZeRO's flat partitions hold one for every
    parameter), so AdamW's weight decay and moments still apply to it, where plain PyTorch skips a None gradient."""
    return plain_reference(pattern, world, steps, unused_as_zero=True)


def offload_state(engine: Any) -> tuple[bool, bool]:
    """Whether the engine's ZeRO optimizer offloads (its optimizer state and step, its parameters), as it says."""
    opt = engine.optimizer
    if zero_stage(engine) == 3:
        return bool(opt.offload_optimizer), bool(opt.offload_param)
    return bool(opt.cpu_offload), False


def _full(engine: Any) -> tuple[dict[str, torch.Tensor | None], ...]:
    from deepspeed.utils import safe_get_full_grad

    from distckpt.runtime.swap import _clean_fqn

    out = {}
    for n, p in engine.module.named_parameters():
        if p.requires_grad:
            g = safe_get_full_grad(p)  # a collective: the reduced gradient, assembled from every rank's partition
            out[_clean_fqn(n)] = None if g is None else g.detach().clone().view(getattr(p, "ds_shape", p.shape))
    return out


def _params(engine: Any) -> dict[str, torch.Tensor]:
    import deepspeed

    from distckpt.runtime.swap import _clean_fqn

    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params]):  # ZeRO-3: whole on every rank while inside
        return {_clean_fqn(n): p.detach().clone() for n, p in params}


def fit(rank: int, world: int, name: str, stage: int, how: str = "distckpt", **kwargs: Any) -> tuple:
    """One pattern under ZeRO-``stage``: ``("ok", (per-step full grads, final params))`` or ``("error", type,
    message)``. ``how``: ``"distckpt"`` (distckpt.integrations.deepspeed.initialize) or ``"plain"`` (today's way:
    ``distckpt.wrap`` then ``deepspeed.initialize``, no distckpt state). ``cpu_adam``: a ``TORCH_EXTENSIONS_DIR``
    holding DeepSpeed's built ``cpu_adam`` op, to train with ``DeepSpeedCPUAdam`` instead of torch's AdamW."""
    try:
        return "ok", _fit(rank, world, name, stage, how, **kwargs)
    except Exception as e:  # noqa: BLE001 - the test asserts on the type and message
        return "error", type(e).__name__, str(e)


def _fit(
    rank: int,
    world: int,
    name: str,
    stage: int,
    how: str,
    *,
    graph: str = "auto",
    reentrant: bool = False,
    guard: bool = False,
    steps: int = STEPS,
    zero: dict | None = None,
    leaves: tuple[type, ...] = (),
    cpu_adam: str | None = None,
) -> tuple:
    setup()
    import deepspeed

    from distckpt.integrations import deepspeed as dc_deepspeed

    pattern = pattern_of(name)
    model = build(pattern)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(trained) if cpu_adam is None else _cpu_adam(trained, cpu_adam)
    cfg = config(stage, world, pattern.micro_batches, **(zero or {}))
    if leaves:  # DeepSpeed's own way for a block whose submodules run on some ranks only (ZeRO-3)
        deepspeed.utils.set_z3_leaf_modules(model, list(leaves))
    check = None
    if how == "distckpt":  # the guard in a step pre-hook of the optimizer (initialize's guard_every)
        engine, *_ = dc_deepspeed.initialize(
            model, blocks=pattern.blocks, reentrant=reentrant, graph=graph, guard_every=int(guard), optimizer=opt,
            config=cfg,
        )  # fmt: skip
    else:  # the guard called by hand, after backward, before engine.step()
        distckpt.wrap(model, "full", blocks=pattern.blocks, reentrant=reentrant)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        check = distckpt.GradSyncGuard(engine) if guard else None
    grads = []
    try:
        wanted = tuple(k in (zero or {}) for k in ("offload_optimizer", "offload_param"))
        assert offload_state(engine) == wanted, f"ZeRO-Offload {offload_state(engine)} in effect, {wanted} asked for"
        for step in range(steps):
            xs = micro_batches(pattern, step, rank, world)
            for m, x in enumerate(xs):
                engine.backward(pattern.loss(engine, x, step * len(xs) + m, rank))
                if m == len(xs) - 1:
                    grads.append(_full(engine))
                    if check is not None:
                        check.check()
                engine.step()
        if guard and how == "distckpt":
            checked = dc_deepspeed.guard(engine).step
            assert checked == steps, f"GradSyncGuard ran {checked} times in {steps} steps"
        return grads, _params(engine)
    finally:
        engine.destroy()


def _cpu_adam(params: list[torch.nn.Parameter], extensions: str) -> torch.optim.Optimizer:
    """DeepSpeed's ``DeepSpeedCPUAdam`` as make_optimizer's AdamW (lr, weight decay), its C++ op loaded from
    ``extensions`` (a ``TORCH_EXTENSIONS_DIR`` it was built into: test_deepspeed.py builds it before the ranks load
    it, so that no rank compiles)."""
    from accelerate_fit import kept_environ
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    with kept_environ():  # the op loads in the constructor; the pool's later calls see the environment as before
        os.environ["TORCH_EXTENSIONS_DIR"] = extensions
        return DeepSpeedCPUAdam(params, lr=1e-2, weight_decay=0.1, adamw_mode=True)


# --- HF Trainer with TrainingArguments(deepspeed=...) -------------------------------------------------------------

HF_LR = 0.1


def hf_config(stage: int, offloaded: bool = False) -> dict[str, Any]:
    """A DeepSpeed config as HF users write it: Trainer fills the "auto" values from TrainingArguments; SGD (Trainer's
    ``optim="sgd"``, passed to DeepSpeed as a client optimizer) is one DeepSpeed has not tested with ZeRO.
    ``offloaded``: ZeRO-Offload (:func:`offload`), with the client optimizer allowed there."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            **(offload(stage) if offloaded else {}),
        },
    }


def hf_fit(
    rank: int,
    world: int,
    name: str,
    stage: int,
    how: str,
    model_init: bool = False,
    offloaded: bool = False,
    **options: Any,
) -> dict[str, Any]:
    """Pattern ``name`` under ``Trainer(args=TrainingArguments(deepspeed=hf_config(stage, offloaded)))`` (SGD, lr 0.1,
    no clipping): ``how`` "distckpt" (DistckptCallback + distckpt.integrations.hf.prepare) or "wrap" (distckpt.wrap on
    the model only); ``model_init``: ``Trainer(model_init=...)`` building a fresh model at each call. {"params",
    "optimizer", "engine", "guard_checks" (per logged step)} or {"error": (type, message)}."""
    setup()
    import tempfile

    import deepspeed
    from accelerate_fit import kept_environ
    from hf_fit import LossTrainer, PatternData, _one_item, _release_accelerate, pattern_loss, training_args

    from distckpt.integrations.hf import DistckptCallback, prepare
    from distckpt.runtime.swap import _clean_fqn

    pattern = PATTERNS[name]
    model = build(pattern)
    callbacks = []
    if how == "distckpt":
        callbacks.append(DistckptCallback(blocks=pattern.blocks, **{"guard_every": 1, **options}))
    else:
        distckpt.wrap(model, "full", blocks=pattern.blocks)
    with tempfile.TemporaryDirectory() as out, kept_environ():
        try:
            args = training_args(
                out, accumulate=pattern.micro_batches, batch_size=1, deepspeed=hf_config(stage, offloaded)
            )
            args.learning_rate = HF_LR
            trainer = LossTrainer(
                **({"model_init": lambda: build(pattern)} if model_init else {"model": model}),
                args=args,
                train_dataset=PatternData(name, world),
                data_collator=_one_item,
                callbacks=callbacks,
                loss=pattern_loss(name),
            )
            if how == "distckpt":
                prepare(trainer)
            trainer.train()
            engine = trainer.model_wrapped
            params = list(engine.module.named_parameters())
            with deepspeed.zero.GatheredParameters([p for _, p in params]):
                values = {_clean_fqn(n): p.detach().clone() for n, p in params}
            return {
                "params": values,
                "optimizer": type(engine.optimizer.optimizer).__name__,
                "engine": type(engine).__name__,
                "offloaded": offload_state(engine),
                "guard_checks": [h.get("distckpt_guard_checks") for h in trainer.state.log_history if "loss" in h],
            }
        except Exception as e:  # noqa: BLE001 - what Trainer raises is the measurement
            return {"error": (type(e).__name__, str(e))}
        finally:
            _release_accelerate()


def hf_reference(name: str, world: int, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The final parameters of :func:`reference`'s run with Trainer's SGD (lr 0.1, no momentum, no weight decay)
    instead of AdamW."""
    pattern = PATTERNS[name]
    model = build(pattern)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=HF_LR)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for r in range(world):
            xs = micro_batches(pattern, step, r, world)
            pattern.schedule(model, pattern.loss, xs, step, r, contextlib.nullcontext, 1.0 / world)
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}
