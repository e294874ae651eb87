"""FSDP2/HSDP stages under a pipeline schedule that splits each backward (zero-bubble): refused with a ConfigError at
the schedule's first step, on every rank, before any micro-batch runs (torch 2.13 cannot make it right)."""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn as nn

from distckpt import _torch_compat as compat
from distckpt.errors import ConfigError

__all__ = ["refuse_split_backward"]

_FIX = (
    "Use ScheduleGPipe, Schedule1F1B or ScheduleInterleaved1F1B with FSDP2, or {name} without data parallelism "
    "(each stage distckpt.wrap'ped only, not parallelized)."
)


def refuse_split_backward(root: nn.Module) -> None:
    """Make ``root`` (a ``fully_shard``ed model, a pipeline stage's module) refuse a schedule that splits its backward.

    A zero-bubble schedule computes each micro-batch's weight gradients in a second pass, with respect to
    ``stage.submod.parameters()``: FSDP2's sharded parameters, which its forward never used (it computes with the
    unsharded ones). Plain ``fully_shard`` then leaves such a gradient None, silently; under ``parallelize`` torch
    raises ``Trying to backward through the graph a second time``, on some ranks while the others wait for them.
    The check runs where every rank's stages pass at the end of the first step's shape inference, after its last
    send or receive and before any micro-batch's: the schedule reshards each FSDP2 module of its stages there
    (``_post_metadata_inference_cleanup``), so every rank that runs such a stage raises and none waits for one that
    did. A reshard outside a schedule's step (``model.to()``) costs a walk up the call stack.

    Args:
        root: the model ``fully_shard`` was applied to last (an ``FSDPModule``).
    """
    root.reshard = types.MethodType(_checked_reshard, root)  # type: ignore[method-assign]


def _checked_reshard(self: Any) -> None:
    running = compat.running_pipeline()
    # Only where a stage reshards its own modules (the first step's shape inference ends so on every rank), not at
    # the schedule's RESHARD actions mid-step, where a peer may wait for this rank. A stage given a dw_builder runs a
    # full backward in its input pass and the user's function in its weight pass: FSDP2 sees a plain backward there.
    if running is not None and running[1] is not None and running[1].dw_builder is None:
        schedule = running[0]
        if compat.splits_backward(schedule):
            name, version = type(schedule).__name__, torch.__version__.split("+")[0]
            raise ConfigError(
                f"{name} does not work with FSDP2 stages (distckpt.parallelize 'fsdp2' or 'hsdp') in torch {version}: "
                "it computes each micro-batch's weight gradients in a second backward pass, with respect to the "
                "stage's sharded parameters, which FSDP2's forward never used (the gradients would be missing). "
                + _FIX.format(name=name)
            )
    type(self).reshard(self)
