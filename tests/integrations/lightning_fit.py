"""Lightning ``Trainer.fit`` on the ranks of the test pool (tests/harness.py): each pattern of tests/patterns.py as a
LightningModule, its per-step gradients and final parameters, for tests/integrations/test_lightning.py.

The pool's ranks already hold a gloo group and torchrun's variables, so Lightning runs in them as under torchrun
(``LOCAL_RANK`` set: processes created outside), and every pattern of a strategy runs in one pool call.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning_cpu import cpu_fsdp_strategy
from patterns import (
    PATTERNS,
    Block,
    HeadBlock,
    LoraBlock,
    MoELayer,
    full_grads,
    full_params,
    make_optimizer,
    micro_batches,
    sequential,
)
from patterns import build as build_net

import distckpt
from distckpt.integrations.lightning import DistckptDDPStrategy, DistckptFSDPStrategy

STEPS = 3
STRATEGIES = {"ddp": DistckptDDPStrategy, "fsdp": DistckptFSDPStrategy}


class _ManualLoss:
    """A loss whose ``.backward()`` is ``manual_backward``: the pattern's own schedule runs unchanged."""

    def __init__(self, lm: pl.LightningModule, t: torch.Tensor):
        self.lm, self.t = lm, t

    def __mul__(self, s: float) -> _ManualLoss:
        return _ManualLoss(self.lm, self.t * s)

    def backward(self) -> None:
        self.lm.manual_backward(self.t)


class PatternModule(pl.LightningModule):
    """The pattern's model as ``self.net``; ``training_step`` is its loss (automatic optimization, micro-batches by
    ``accumulate_grad_batches``), or its whole schedule with ``manual_backward`` (the schedules with several
    backwards per step: ``toggle_model(sync_grad=False)`` is the accumulate context)."""

    def __init__(self, name: str, manual: bool = False):
        super().__init__()
        self.pattern = PATTERNS[name]
        self.net = build_net(self.pattern)
        self.automatic_optimization = not manual

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        rank = self.trainer.global_rank
        if self.automatic_optimization:
            return self.pattern.loss(self.net, batch, batch_idx, rank)
        opt = self.optimizers()
        opt.zero_grad()

        def loss(model, x, step, r):
            return _ManualLoss(self, self.pattern.loss(model, x, step, r))

        self.pattern.schedule(self.net, loss, batch, batch_idx, rank, lambda: opt.toggle_model(sync_grad=False), 1.0)
        opt.step()
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer([p for p in self.parameters() if p.requires_grad])


def _clean(named: dict[str, Any]) -> dict[str, Any]:
    return {k.removeprefix("net."): v for k, v in named.items()}


class _Record(pl.Callback):
    """Each optimizer step's full gradients (the reference's names), and the gradient reductions per micro-batch."""

    def __init__(self, strategy: str):
        self.strategy = strategy
        self.grads: list[dict] = []
        self.reductions: list[int] = []  # per training batch: gradient all-reduces / reduce-scatters it ran
        self._count = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append(_clean(full_grads(trainer.strategy.model, self.strategy)))

    def on_train_start(self, trainer, pl_module) -> None:
        count_reductions(trainer.strategy.model, self)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.reductions.append(self._count)
        self._count = 0


def count_reductions(model: torch.nn.Module, rec: _Record) -> None:
    """Count the gradient reductions of a DDP or FSDP1 model through its public comm-hook API (the same
    arithmetic as the default hooks: divide by the world size, then sum)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    world = dist.get_world_size()

    def ddp_hook(state, bucket):
        rec._count += 1
        fut = dist.all_reduce(bucket.buffer().div_(world), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    def fsdp_hook(state, grad, output=None):
        rec._count += 1
        grad.div_(world)
        if output is None:
            dist.all_reduce(grad)
        else:
            dist.reduce_scatter_tensor(output, grad)

    if isinstance(model, FSDP):
        model.register_comm_hook(None, fsdp_hook)
    else:
        model.register_comm_hook(None, ddp_hook)


def _batches(name: str, rank: int, world: int, manual: bool) -> list[Any]:
    """One training batch per micro-batch (automatic optimization), or one list of micro-batches per step."""
    pattern = PATTERNS[name]
    steps = [micro_batches(pattern, s, rank, world) for s in range(STEPS)]
    return steps if manual else [x for xs in steps for x in xs]


# Lightning's own ways, without distckpt (docs/integrations.md's table): its DDPStrategy with PyTorch's
# checkpoint_wrapper on the blocks (Lightning has no checkpointing option for DDP: configure_model does this), the
# same with the find_unused_parameters=True that Lightning's error message suggests, and FSDPStrategy's own
# activation_checkpointing_policy (one unit per block).
OWN = ("ddp", "ddp_find_unused_parameters_true", "fsdp")


def _block_types() -> set[type]:
    return {Block, LoraBlock, HeadBlock, MoELayer}


def own_strategy(own: str, lm: pl.LightningModule, reentrant: bool) -> Any:
    """Lightning's own strategy ``own`` (of OWN) and checkpointing, applied to ``lm`` as a user would."""
    if own == "fsdp":
        return cpu_fsdp_strategy(auto_wrap_policy=_block_types(), activation_checkpointing_policy=_block_types())
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    apply_activation_checkpointing(
        lm.net,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
        check_fn=lambda m: isinstance(m, tuple(_block_types())),
    )
    return DDPStrategy(find_unused_parameters=own != "ddp")


def fit(
    rank: int,
    world: int,
    name: str,
    strategy: str,
    *,
    reentrant: bool = False,
    guard_every: int = 1,
    callbacks: tuple = (),
    own: str | None = None,
    **options: Any,
) -> tuple[list[dict], dict, list[int]]:
    """``Trainer.fit`` of pattern ``name``: (per-step grads, final params, gradient reductions per batch).
    ``own``: Lightning's own strategy and checkpointing instead of distckpt's (one of OWN; ``strategy`` then
    says which of "ddp"/"fsdp" it is)."""
    pattern = PATTERNS[name]
    manual = pattern.schedule is not sequential
    env = dict(os.environ)
    rec = _Record(strategy)
    lm = PatternModule(name, manual=manual)
    if own is None:
        chosen = STRATEGIES[strategy](blocks=pattern.blocks, reentrant=reentrant, guard_every=guard_every, **options)
    else:
        chosen = own_strategy(own, lm, reentrant)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=chosen,
        max_steps=STEPS,
        accumulate_grad_batches=1 if manual else pattern.micro_batches,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[rec, *callbacks],
        default_root_dir=f"/tmp/distckpt-lightning-{os.getpid()}",
    )
    try:
        trainer.fit(lm, torch.utils.data.DataLoader(_batches(name, rank, world, manual), batch_size=None))
    finally:
        os.environ.clear()
        os.environ.update(env)  # LightningEnvironment.teardown deletes WORLD_SIZE, which the pool's ranks keep
    params = _clean(full_params(trainer.strategy.model if strategy == "fsdp" else lm, strategy))
    return rec.grads, params, rec.reductions


def outcome(rank: int, world: int, name: str, strategy: str, **kwargs: Any) -> tuple:
    """("ok", fit's result) or ("refused", error type, message): caught on the rank, which keeps the pool alive when
    every rank raises it at the same point."""
    try:
        return ("ok", fit(rank, world, name, strategy, **kwargs))
    except (distckpt.ConfigError, distckpt.GradDesyncError) as e:
        return ("refused", type(e).__name__, str(e))


def sweep(rank: int, world: int, names: list[str], strategy: str, **kwargs: Any) -> dict[str, tuple]:
    """Every pattern of ``names`` in one call: {name: outcome}."""
    return {name: outcome(rank, world, name, strategy, **kwargs) for name in names}


class PerturbGrad(pl.Callback):
    """A desync injected on purpose: rank ``rank`` adds ``delta`` to ``param``'s gradient after backward."""

    def __init__(self, rank: int, param: str, delta: float = 1e-3):
        self.rank, self.param, self.delta = rank, param, delta

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_rank == self.rank:
            dict(pl_module.named_parameters())[self.param].grad.add_(self.delta)
