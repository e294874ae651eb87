"""``distckpt plan``: per-rank memory and recompute of every checkpointing policy for a model and a
cluster we cannot run, from one sample step on fake tensors (no data, no allocation).

How: the factory builds the model under ``FakeTensorMode``; the repeated blocks are cut down to a few
(the first, a middle one, one of each other distinct shape, the last); :func:`profile_model` measures
that short model's sample step (saved tensors, ``MemTracker``, ``FlopCounterMode``: all work on fake
tensors); the profile is stretched back to every block (a cut block takes the numbers of the kept
block of its shape, its gradient counts shifted by the blocks it lost behind it: both in
:mod:`distckpt.select.profile.fake_profile`, which ``budget:auto`` plans on too); and the budget
module's memory model places parameters, gradients and optimizer state for the strategy and world size.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from distckpt import _torch_compat as compat
from distckpt.errors import ConfigError
from distckpt.factory import load_factory
from distckpt.select import find_blocks
from distckpt.select.budget import optimizer_terms, plan_budget, predicted_peak, shards, static_bytes
from distckpt.select.profile import Call, ModelProfile, as_args, batch_tensors, profile_cut

__all__ = ["PlanReport", "PolicyEstimate", "plan_at_scale", "render"]


@dataclass(frozen=True)
class PolicyEstimate:
    """One policy's predicted peak per rank, its recompute FLOPs per step and the blocks it checkpoints."""

    policy: str
    peak_bytes: int
    recompute_flops: int
    checkpointed: tuple[int, ...]
    # per block: "none", "pointwise", "selective", "full", or (a budget) the KeepOps of an "ops" block
    modes: tuple[Any, ...] = ()


@dataclass(frozen=True)
class PlanReport:
    """What :func:`plan_at_scale` predicts for one rank (bytes; FLOPs per training step)."""

    strategy: str
    world_size: int
    shard_size: int | None
    optimizer: str
    blocks: tuple[str, ...]
    traced_blocks: int  # blocks traced on fake tensors (the others take their numbers)
    total_params: int  # parameter count of the whole model
    param_bytes: int  # per rank (sharded strategies: the shard plus the unsharded non-block parameters)
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # held for backward without checkpointing
    forward_flops: int  # one forward of the blocks
    policies: tuple[PolicyEstimate, ...]
    budget_bytes: int | None
    budget_error: str = ""  # why no choice fits the budget, when none does
    profile: ModelProfile | None = field(default=None, repr=False, compare=False)  # the stretched profile
    tp: int = 1  # tensor-parallel ranks: world_size // tp data-parallel ranks shard what FSDP shards

    def with_budget(self, budget: int, *, grad_accumulation: bool = False) -> PlanReport:
        """The same report with the ``budget`` plan for ``budget`` bytes (no new trace).

        Raises:
            ConfigError: no choice fits (the message names the smallest budget that does).
        """
        assert self.profile is not None, "reports from plan_at_scale carry their profile"
        bp = plan_budget(
            self.profile,
            budget,
            strategy=self.strategy,
            world_size=self.world_size // self.tp,
            shard_size=self.shard_size,
            optimizer=self.optimizer,
            grad_accumulation=grad_accumulation,
        )
        rest = tuple(p for p in self.policies if p.policy != "budget")
        est = PolicyEstimate("budget", bp.peak_bytes, bp.recompute_flops, bp.selected, bp.placement)
        return dataclasses.replace(self, policies=(*rest, est), budget_bytes=budget, budget_error="")

    def policy(self, name: str) -> PolicyEstimate:
        """The estimate of ``name`` (``none``, ``full``, ``pointwise``, ``selective``, ``budget``)."""
        return next(p for p in self.policies if p.policy == name)


def _resize(batch: Any, micro_batch: int | None, seq_len: int | None) -> Any:
    """``batch`` with its leading (batch) and second (sequence) sizes replaced, values left undefined:
    every tensor whose dim 0 has the batch's leading size, and dim 1 its first sequence length."""
    leaves = [t for t in batch_tensors(batch) if t.dim() > 0]
    if not leaves or (micro_batch is None and seq_len is None):
        return batch
    b0 = leaves[0].shape[0]
    s0 = next((t.shape[1] for t in leaves if t.dim() > 1), None)

    def resize(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return t
        shape = list(t.shape)
        if micro_batch is not None and shape[0] == b0:
            shape[0] = micro_batch
        if seq_len is not None and t.dim() > 1 and shape[1] == s0:
            shape[1] = seq_len
        return t.new_zeros(shape) if shape != list(t.shape) else t

    return compat.tree_map(resize, batch)


class _LossModule(nn.Module):
    """The model and the factory's loss as one module: the profile runs ``module(batch)``."""

    def __init__(self, model: nn.Module, loss_fn: Callable[[nn.Module, Any], torch.Tensor]) -> None:
        super().__init__()
        self.m = model
        self.loss_fn = loss_fn

    def forward(self, batch: Any) -> torch.Tensor:
        return self.loss_fn(self.m, batch)


def _subject(factory: Any, example_inputs: Any) -> tuple[nn.Module, nn.Module, str, Any]:
    """(model, module to profile, prefix of block names in it, sample call) from a factory."""
    made = (load_factory(factory) if isinstance(factory, str) else factory)()
    if isinstance(made, nn.Module):
        if example_inputs is None:
            raise ConfigError(
                "plan_at_scale: a factory returning only a model needs example_inputs= (one "
                "rank's micro-batch, as model(*example_inputs) takes it)."
            )
        return made, made, "", example_inputs
    model, loss_fn, batch_fn = made
    # The factory's batch (rank 0 of 1) is one rank's micro-batch; --micro-batch/--seq-len resize it.
    if example_inputs is None:
        with compat.outside_fake_mode():  # a loader reads values (its shuffle); the fake model takes real inputs
            batch = batch_fn(0, 0, 1)
    else:
        batch = example_inputs
    return model, _LossModule(model, loss_fn), "m.", Call((batch,), {})


def _per_rank(
    mp: ModelProfile, strategy: str, world_size: int, shard_size: int | None, optimizer: str
) -> tuple[int, int, int]:
    """Parameters, gradients and optimizer state per rank: the sharding of budget.static_bytes
    (shards of ``1/shards()``), without its working set of unsharded blocks (that is in the peak)."""
    k, steps = optimizer_terms(mp, optimizer)
    div = shards(strategy, world_size, shard_size)
    return mp.param_bytes // div, mp.trainable_bytes // div, k * mp.trainable_bytes // div + steps


def plan_at_scale(
    factory: Any,
    *,
    strategy: str = "fsdp2",
    world_size: int = 1,
    shard_size: int | None = None,
    micro_batch: int | None = None,
    seq_len: int | None = None,
    budget: int | None = None,
    optimizer: str = "adamw",
    grad_accumulation: bool = False,
    blocks: Any = None,
    example_inputs: Any = None,
    tp: int = 1,
) -> PlanReport:
    """Predict one rank's peak training memory and recompute FLOPs under ``none``, ``full``,
    ``pointwise``, ``selective`` and a ``budget`` plan, without allocating the model (``FakeTensorMode``).

    Args:
        factory: ``"pkg.module:make"`` or a callable; ``make()`` returns ``(model, loss_fn, batch_fn)``
            (the doctor's contract, :mod:`distckpt.check.doctor`) or just a model (then pass
            ``example_inputs``). It runs under ``FakeTensorMode``: it must not read tensor values.
        strategy: ``"ddp"``, ``"fsdp"``, ``"fsdp2"``, ``"hsdp"`` or ``"none"``.
        world_size: ranks; ``shard_size``: ``"hsdp"``'s sharding group.
        micro_batch, seq_len: resize the sample batch's leading and sequence dimensions.
        budget: bytes per rank for the ``budget`` plan (``None``: no budget plan).
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd"``, ``"sgd_momentum"`` or ``"none"``.
        grad_accumulation: gradients persist across micro-batches.
        blocks: the candidate blocks (as ``wrap``'s ``blocks=``); ``None`` finds them.
        example_inputs: overrides the factory's batch.
        tp: tensor-parallel ranks (``"fsdp2"``; dividing ``world_size``): each block is traced with the shapes one
            tensor-parallel rank holds (:func:`distckpt.select.tp_shapes.shrink_for_tp`: the attention and MLP
            linears and the activations between them ``1/tp``), and FSDP shards over ``world_size // tp`` ranks.

    Returns:
        A :class:`PlanReport`.

    Raises:
        ConfigError: a bad strategy, optimizer, shard size, tp or factory, or a model that reads tensor
            values while it runs (it cannot run on fake tensors).
    """
    from distckpt.options import check_tp
    from distckpt.select.tp_shapes import shrink_for_tp

    # The strategy, shard size, tp and optimizer are checked (as _report checks them) before seconds of tracing.
    check_tp(tp, strategy, world_size)
    dp = world_size // tp
    static_bytes(ModelProfile(blocks=()), strategy=strategy, world_size=dp, optimizer=optimizer, shard_size=shard_size)
    with compat.fake_mode():
        model, root, prefix, call = _subject(factory, example_inputs)
        call = Call(*_resize(as_args(call), micro_batch, seq_len))
        root.train()
        found = find_blocks(model, blocks)
        if tp > 1:
            shrink_for_tp(model, found, tp)
        mp, kept = profile_cut(root, model, found, call, prefix=prefix)
    report = _report(
        mp,
        found,
        kept,
        strategy=strategy,
        world_size=dp,
        shard_size=shard_size,
        optimizer=optimizer,
        grad_accumulation=grad_accumulation,
    )
    report = dataclasses.replace(report, world_size=world_size, tp=tp)
    if budget is None:
        return report
    try:
        return report.with_budget(budget, grad_accumulation=grad_accumulation)
    except ConfigError as e:
        return dataclasses.replace(report, budget_bytes=budget, budget_error=str(e))


def _report(
    mp: ModelProfile,
    found: list[tuple[str, nn.Module]],
    kept: list[int],
    *,
    strategy: str,
    world_size: int,
    shard_size: int | None,
    optimizer: str,
    grad_accumulation: bool,
) -> PlanReport:
    kw = dict(
        strategy=strategy,
        world_size=world_size,
        shard_size=shard_size,
        optimizer=optimizer,
        grad_accumulation=grad_accumulation,
    )
    static_bytes(mp, strategy=strategy, world_size=world_size, optimizer=optimizer, shard_size=shard_size)  # checks
    n = len(mp.blocks)
    policies = [
        PolicyEstimate("none", predicted_peak(mp, [], **kw), 0, (), ("none",) * n),
        PolicyEstimate(
            "full",
            predicted_peak(mp, range(n), **kw),
            sum(b.full_flops for b in mp.blocks),
            tuple(range(n)),
            ("full",) * n,
        ),
    ]
    for op in ("pointwise", "selective"):
        # The op-level mode where the profile could run it (a block whose sample step failed is counted full).
        modes = tuple(op if b.mode_held_flops(op)[0] >= 0 else "full" for b in mp.blocks)
        flops = sum(b.mode_held_flops(m)[1] for b, m in zip(mp.blocks, modes))
        policies.append(PolicyEstimate(op, predicted_peak(mp, modes, **kw), flops, tuple(range(n)), modes))
    params, grads, optim = _per_rank(mp, strategy, world_size, shard_size, optimizer)
    total = sum(p.numel() for p in {id(p): p for _, m in found for p in m.parameters()}.values())
    return PlanReport(
        strategy=strategy,
        world_size=world_size,
        shard_size=shard_size,
        optimizer=optimizer,
        blocks=tuple(name for name, _ in found),
        traced_blocks=len(kept),
        total_params=_param_count(mp, found, total),
        param_bytes=params,
        grad_bytes=grads,
        optimizer_bytes=optim,
        activation_bytes=mp.activation_bytes,
        forward_flops=sum(b.forward_flops for b in mp.blocks),
        policies=tuple(policies),
        budget_bytes=None,
        profile=mp,
    )


def _param_count(mp: ModelProfile, found: list[tuple[str, nn.Module]], block_params: int) -> int:
    """Parameters of the whole model, from its bytes (the blocks' own element size for the rest)."""
    size = next((p.element_size() for _, m in found for p in m.parameters()), 4)
    return block_params + max(0, mp.param_bytes - block_params * size) // size


def _fmt(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _flops(n: float) -> str:
    return (
        "0"
        if not n
        else f"{n / 10 ** (3 * (e := min(5, int(math.log10(n)) // 3))):.2f} "
        + ["", "K", "M", "G", "T", "P"][e]
        + "FLOP"
    )


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _ranges(idx: tuple[int, ...]) -> str:
    out, start = [], None
    for k, i in enumerate(idx):
        if start is None:
            start = i
        if k + 1 == len(idx) or idx[k + 1] != i + 1:
            out.append(str(start) if start == i else f"{start}-{i}")
            start = None
    return ",".join(out) or "-"


def _blocks(p: PolicyEstimate) -> str:
    """The checkpointed blocks, by mode when a plan mixes them (``full 0-3, selective 4-79``)."""
    # The most recompute (or transfer) first: offload, full, then the per-op and op-level modes.
    names = {str(x) for x in p.modes}  # a KeepOps is the "ops" mode
    used = [m for m in ("offload", "full", "ops", "selective", "pointwise") if m in names]
    if len(used) < 2:
        return _ranges(p.checkpointed)
    return ", ".join(f"{m} {_ranges(tuple(i for i, x in enumerate(p.modes) if str(x) == m))}" for m in used)


def render(r: PlanReport) -> str:
    """The report as ``distckpt plan`` prints it."""
    where = f"{r.strategy}, {r.world_size} ranks" + (f", shard size {r.shard_size}" if r.shard_size else "")
    if r.tp > 1:
        where += f" ({r.world_size // r.tp} dp x {r.tp} tp)"
    lines = [
        f"distckpt plan: {_count(r.total_params)} parameters, {len(r.blocks)} blocks ({r.blocks[0]}, ...; "
        f"{r.traced_blocks} traced), {where}, {r.optimizer}",
        "per rank:",
        f"  parameters        {_fmt(r.param_bytes):>12}",
        f"  gradients         {_fmt(r.grad_bytes):>12}",
        f"  optimizer state   {_fmt(r.optimizer_bytes):>12}",
        f"  activations       {_fmt(r.activation_bytes):>12}  (no checkpointing; one forward of the blocks: "
        f"{_flops(r.forward_flops)})",
        f"  {'policy':<10} {'peak':>12}  {'recompute':>13}  checkpointed blocks",
    ]
    for p in r.policies:
        label = p.policy if p.policy != "budget" else f"budget:{_fmt(r.budget_bytes).replace(' ', '')}"
        lines.append(f"  {label:<10} {_fmt(p.peak_bytes):>12}  {_flops(p.recompute_flops):>13}  {_blocks(p)}")
    if r.budget_error:
        lines.append(f"  budget: {r.budget_error}")
    return "\n".join(lines)
