"""What to checkpoint. The policy layer at the top: blocks (which modules may be checkpointed), policies
(spec strings and policy objects, the :class:`PlannedPolicy` protocol a budget implements) over
candidates (what a policy sees, and the :class:`Parallelism` a plan counts memory for). Below it two
sub-packages: budget/ (the memory planner) over profile/ (per-block bytes and FLOPs of a sample step).

Everything outside this package imports from here or from a sub-package's ``__init__``.
"""

from distckpt.runtime.selective import KeepOps
from distckpt.select.blocks import BlockSpec, conditional_reason, find_blocks, repeated_block_groups
from distckpt.select.candidates import Candidates, Parallelism
from distckpt.select.policies import (
    CHECKPOINT_MODES,
    Budget,
    EveryN,
    FirstN,
    Fraction,
    Full,
    Placement,
    PlannedPolicy,
    Policy,
    Selective,
    is_planned,
    parse_policy,
    parse_size,
    select_blocks,
)

__all__ = [
    "CHECKPOINT_MODES",
    "BlockSpec",
    "Budget",
    "Candidates",
    "EveryN",
    "FirstN",
    "Fraction",
    "Full",
    "KeepOps",
    "Parallelism",
    "Placement",
    "PlannedPolicy",
    "Policy",
    "Selective",
    "conditional_reason",
    "find_blocks",
    "is_planned",
    "parse_policy",
    "parse_size",
    "repeated_block_groups",
    "select_blocks",
]
