"""What a policy sees when it chooses: the candidate blocks, the sample batch, and their profile
(measured once, on demand); and how the model runs (:class:`Parallelism`), which a plan that counts
memory needs. Below the policies and the budget planner, which both take them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.nn as nn

from distckpt.errors import ConfigError

if TYPE_CHECKING:
    from distckpt.select.profile import BlockProfile, ModelProfile

__all__ = ["Candidates", "Parallelism"]


@dataclass(frozen=True)
class Parallelism:
    """How the checkpointed model runs, as a memory plan counts it: the data-parallel ``strategy``
    (``"none"``, ``"ddp"``, ``"fsdp"``, ``"fsdp2"``, ``"hsdp"``), the data-parallel ranks and, under
    ``"hsdp"``, the ranks that shard (``shard_size``). ``strategy=None``: not known yet (at ``wrap``,
    before ``parallelize`` says).
    """

    strategy: str | None
    world_size: int = 1
    shard_size: int | None = None


@dataclass
class Candidates:
    """What a policy sees when it chooses: the candidate blocks in registration order (the budget's profile
    measures and plans them in the order they run: ``ModelProfile.run_order``).

    ``profile()`` measures activation bytes and recompute cost per block on ``example_inputs``
    (only the budget policy needs it; it runs at most once per ``wrap`` call). ``preserve_rng_state``:
    whether the checkpoints will save the RNG state (``wrap``'s option); without it the profile
    counts none held per checkpointed block. ``op_level``: whether op-level modes (``pointwise``,
    ``selective``) may be chosen; False under reentrant checkpointing, which takes no op-level policy.
    """

    model: nn.Module
    blocks: list[tuple[str, nn.Module]]
    example_inputs: Any = None
    world_size: int = 1
    preserve_rng_state: bool = True
    op_level: bool = True
    _profile: ModelProfile | None = field(default=None, repr=False)
    _profile_modes: frozenset[str] = field(default=frozenset(), repr=False)

    def profile(self) -> list[BlockProfile]:
        return list(self.model_profile().blocks)

    def model_profile(self, modes: Any = None) -> ModelProfile:
        """The whole-step profile (blocks plus parameters, head, temporaries); see distckpt.select.profile.
        ``modes``: the recompute modes to measure (default: every one, ``RECOMPUTE_MODES``)."""
        from distckpt.select.profile import RECOMPUTE_MODES, profile_model

        wanted = frozenset(RECOMPUTE_MODES if modes is None else modes)
        if self._profile is None or not wanted <= self._profile_modes:
            if self.example_inputs is None:
                raise ConfigError(
                    "this policy needs a sample batch to measure activation memory; pass "
                    "example_inputs=(args...) or {kwargs} to distckpt.wrap."
                )
            self._profile = profile_model(self.model, self.blocks, self.example_inputs, modes=wanted)
            self._profile_modes = wanted
        if not self.preserve_rng_state:  # a checkpoint keeps no RNG state from its forward to its backward
            return dataclasses.replace(self._profile, rng_state_bytes=0)
        return self._profile
