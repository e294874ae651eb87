"""What ``wrap`` decided for a model, kept on it for ``parallelize`` and ``compile_blocks``: one
:class:`WrapState` under one attribute of the model (:data:`WRAP_STATE`), read through :func:`wrap_state`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.nn as nn

from distckpt.errors import ConfigError
from distckpt.runtime.swap import _clean_fqn
from distckpt.select import Parallelism, Policy, find_blocks

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

    from distckpt.runtime.recompute import CheckpointOptions

__all__ = ["WRAP_STATE", "WrapState", "candidate_blocks", "pending_plan", "wrap_state"]

WRAP_STATE = "_distckpt_wrap"  # the attribute of the model (in its __dict__, not a submodule) holding its WrapState


@dataclass
class WrapState:
    """What ``distckpt.wrap`` decided for a model, and how far its plan got: the hand-over between ``wrap``
    and ``parallelize`` (or an integration that builds DDP itself).

    Attributes:
        candidates: the blocks ``wrap`` chose among, checkpointed or not, named as at ``wrap``, in forward
            order; FSDP/FSDP2 make each of them a unit.
        policy: the policy object as given (``None``: nothing checkpointed).
        options: what every checkpointed block runs with (reentrant, RNG state, offload, op-level context);
            ``None`` without a policy.
        example_inputs: the sample batch a :class:`~distckpt.select.PlannedPolicy` profiles (the first
            training forward's inputs when ``wrap`` got none).
        planned_for: the placement the current choice of a planned policy was made for (``None``: not
            planned yet, or a policy that does not depend on it).
        handed_over: the placement ``parallelize`` said the model runs under (``None`` before it did).
        pending: the hook that plans on the first training forward, while a planned policy waits for it.
    """

    candidates: list[tuple[str, nn.Module]]
    policy: Policy | None = None
    options: CheckpointOptions | None = None
    example_inputs: Any = None
    planned_for: Parallelism | None = None
    handed_over: Parallelism | None = None
    pending: RemovableHandle | None = None


def wrap_state(model: nn.Module) -> WrapState | None:
    """The :class:`WrapState` ``distckpt.wrap`` left on ``model``, or ``None`` when it never wrapped it."""
    return model.__dict__.get(WRAP_STATE)


def candidate_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks ``wrap`` chose among (checkpointed or not), in forward order, named as in ``model`` now; for
    a model ``wrap`` never saw, the repeated blocks found automatically, or none when there are no such blocks."""
    state = wrap_state(model)
    if state is None:
        try:
            return find_blocks(model)
        except ConfigError:
            return []
    mine = {id(m) for _, m in state.candidates}
    return [(_clean_fqn(n), m) for n, m in model.named_modules() if id(m) in mine]


def pending_plan(model: nn.Module) -> bool:
    """Whether a planned policy (``budget``) still waits for the first training forward to choose its blocks."""
    state = wrap_state(model)
    return state is not None and state.pending is not None
