"""distckpt: activation checkpointing that stays exact under DDP, FSDP and FSDP2.

Wrap the blocks first, then parallelize::

    distckpt.wrap(model, "full")
    model = distckpt.parallelize(model, "ddp")
"""

from distckpt.apply.chunk import chunk_feed_forward
from distckpt.apply.wrap import checkpointed, checkpointing_disabled, wrap
from distckpt.check.recompute import verify_recompute
from distckpt.check.sync_guard import GradSyncGuard
from distckpt.errors import ConfigError, GradDesyncError, NoGradientError, RecomputeMismatchError
from distckpt.layout import Layout
from distckpt.parallel.strategies import accumulate, ddp_kwargs, parallelize, preflight
from distckpt.runtime.routing import routing_replay_disabled
from distckpt.select import Budget, EveryN, FirstN, Fraction, Full, Selective, parse_policy

__version__ = "0.1.0"

__all__ = [
    "Budget",
    "ConfigError",
    "EveryN",
    "FirstN",
    "Fraction",
    "Full",
    "GradDesyncError",
    "GradSyncGuard",
    "Layout",
    "NoGradientError",
    "RecomputeMismatchError",
    "Selective",
    "accumulate",
    "checkpointed",
    "checkpointing_disabled",
    "chunk_feed_forward",
    "ddp_kwargs",
    "parallelize",
    "parse_policy",
    "preflight",
    "routing_replay_disabled",
    "verify_recompute",
    "wrap",
]
