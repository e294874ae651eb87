"""The ``ac`` group as ``distckpt.wrap``'s arguments: one builder, :func:`wrap_args`, for validation
(``launch/config.py``), training (``launch/run.py``), ``distckpt doctor`` and ``distckpt plan``
(``launch/subject.py``, ``launch/plan.py``), so that all four see the same policy, blocks and budget facts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch.nn as nn
from omegaconf import DictConfig, OmegaConf

import distckpt
from distckpt.errors import ConfigError
from distckpt.select import Budget, EveryN, Policy, parse_policy, parse_size
from launch.build import layout_of

__all__ = ["BudgetFacts", "WrapArgs", "budget_facts", "wrap_args"]


@dataclass(frozen=True)
class BudgetFacts:
    """What a memory plan needs to know about the run: the strategy and (``hsdp``) shard size, the
    optimizer's state (SGD with momentum keeps one, without none) and whether gradients accumulate over
    micro-batches."""

    strategy: str
    optimizer: str
    grad_accumulation: bool
    shard_size: int | None


@dataclass(frozen=True)
class WrapArgs:
    """``distckpt.wrap``'s arguments for a config.

    Attributes:
        policy: the policy object (``None``: ``ac=none``); a :class:`~distckpt.Budget` carries ``facts`` and
            ``ac.offload_flops_per_byte``.
        spec: ``ac.policy`` as written, for summaries and the doctor's verdict.
        blocks: ``ac.blocks`` (FQN globs), or ``None``: the repeated blocks found.
        reentrant: ``ac.reentrant``.
        offload: ``"cpu"`` with ``ac.offload``, else ``None``.
        facts: the run's facts a memory plan counts (``distckpt plan`` reads them too).
    """

    policy: Policy | None
    spec: str
    blocks: tuple[str, ...] | None
    reentrant: bool
    offload: str | None
    facts: BudgetFacts

    def wrap(self, model: nn.Module, *, example_inputs: Any = None, preserve_rng_state: bool = True) -> None:
        """Checkpoint ``model`` as training does. With no policy (``ac=none``) nothing is called: a model
        without repeated blocks (``model=custom``) is fine then."""
        if self.policy is None:
            return
        distckpt.wrap(
            model,
            self.policy,
            blocks=list(self.blocks) if self.blocks else None,
            reentrant=self.reentrant,
            preserve_rng_state=preserve_rng_state,
            offload=self.offload,
            example_inputs=example_inputs,
        )


def budget_facts(cfg: DictConfig, world_size: int) -> BudgetFacts:
    """The :class:`BudgetFacts` of a config run on ``world_size`` ranks."""
    o = cfg.optim
    optimizer = o.name if o.name != "sgd" else ("sgd_momentum" if o.momentum else "sgd")
    layout = layout_of(cfg.strategy, world_size)
    return BudgetFacts(
        strategy=layout.strategy,
        optimizer=optimizer,
        grad_accumulation=cfg.trainer.grad_accum > 1,
        shard_size=layout.shard_size,
    )


def wrap_args(cfg: DictConfig, world_size: int) -> WrapArgs:
    """``distckpt.wrap``'s arguments for ``cfg`` run on ``world_size`` ranks, each field read once.

    A group's own policy (``ac=budget``: ``budget:${ac.size}``, ``ac=every_n``: ``every:${ac.n}``) is built
    from its typed fields; ``ac.policy`` given on the command line is parsed.

    Raises:
        ConfigError: a bad ``ac.size`` or ``ac.policy``, naming the override to fix.
    """
    c = cfg.ac
    size = None
    if c.size != "auto":  # checked whatever the group, as every field is
        try:
            size = parse_size(c.size)
        except ConfigError as e:
            raise ConfigError(f"ac.size={c.size}: {e} Or ac.size=auto (the free CUDA memory).") from None
    facts = budget_facts(cfg, world_size)
    try:
        policy = _policy(c, size)
    except ConfigError as e:
        raise ConfigError(f"ac.policy={c.policy}: {e}") from None
    if isinstance(policy, Budget):  # the run-level facts and the offload price (null: not offered)
        fields = dataclasses.asdict(facts)
        policy = dataclasses.replace(policy, **fields, offload_flops_per_byte=c.offload_flops_per_byte)
    return WrapArgs(
        policy=policy,
        spec=str(c.policy),
        blocks=tuple(c.blocks) if c.blocks else None,
        reentrant=bool(c.reentrant),
        offload="cpu" if c.offload else None,
        facts=facts,
    )


def _policy(c: DictConfig, size: int | None) -> Policy | None:
    """The policy of the ``ac`` node: from the typed fields while ``ac.policy`` is still the group file's
    interpolation of them, else ``ac.policy`` parsed (an override such as ``ac.policy=first:2``)."""
    own = OmegaConf.is_interpolation(c, "policy")
    if own and c.name == "budget":
        return Budget(size)
    if own and c.name == "every_n":
        return EveryN(c.n)
    return parse_policy(c.policy)
