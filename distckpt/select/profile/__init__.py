"""The profiler: activation bytes, recompute cost and FLOPs per candidate block, measured on one sample
training step (profile, over recorder: the first sample step; recompute_passes: the checkpointed steps;
sample_step: what they share), or estimated on fake tensors (fake_profile); the FLOP counter that also
counts CPU attention (flops); the host link's price in FLOPs per byte (transfer).

Everything outside this package imports from here; the modules inside share their underscore helpers
among themselves only.
"""

from distckpt.select.profile.fake_profile import estimate_profile, profile_cut
from distckpt.select.profile.flops import attention_flop_formulas, flop_counter
from distckpt.select.profile.profile import (
    PROFILE_MODES,
    RECOMPUTE_MODES,
    BlockProfile,
    Call,
    ModelProfile,
    adam_step_temp_bytes,
    as_args,
    batch_tensors,
    parameter_fields,
    profile_blocks,
    profile_model,
    step_device,
)
from distckpt.select.profile.sample_step import memory_tracker, scalar_loss
from distckpt.select.profile.transfer import flops_per_byte, probe_shapes

__all__ = [
    "PROFILE_MODES",
    "RECOMPUTE_MODES",
    "BlockProfile",
    "Call",
    "ModelProfile",
    "adam_step_temp_bytes",
    "as_args",
    "attention_flop_formulas",
    "batch_tensors",
    "estimate_profile",
    "flop_counter",
    "flops_per_byte",
    "memory_tracker",
    "parameter_fields",
    "probe_shapes",
    "profile_blocks",
    "profile_cut",
    "profile_model",
    "scalar_loss",
    "step_device",
]
