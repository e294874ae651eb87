"""Which blocks to checkpoint: typed policy objects, and the parser for spec strings.

A spec string such as ``"every:2"`` is parsed once, at the boundary, into a policy object; the
rest of the library only sees objects. "Off" is ``None``, as in torchtitan.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from distckpt.errors import ConfigError
from distckpt.runtime.selective import KEEP_MODE, KeepOps
from distckpt.runtime.swap import CHECKPOINT_MODES
from distckpt.select.candidates import Candidates, Parallelism

__all__ = [
    "Budget",
    "EveryN",
    "FirstN",
    "Fraction",
    "Full",
    "CHECKPOINT_MODES",
    "Candidates",
    "Parallelism",
    "Placement",
    "PlannedPolicy",
    "Policy",
    "Selective",
    "parse_policy",
    "is_planned",
    "parse_size",
]

SPEC_FORMS = (
    '"none", "full", "every:N" (N >= 1), "first:N" (N >= 0), "fraction:F" (0 <= F <= 1), '
    '"budget:SIZE" (e.g. "budget:2GiB", "budget:512MiB", "budget:auto"), "selective"'
)


@runtime_checkable
class Policy(Protocol):
    """A checkpointing policy: ``select`` returns the indices of the blocks to checkpoint.

    ``context_fn`` (optional) returns the ``(forward, recompute)`` context pair that
    ``torch.utils.checkpoint`` runs each checkpointed block under (op-level selective
    checkpointing); ``None`` means plain full recompute. ``modes`` (optional) returns
    ``{index: "pointwise" | "selective" | "full"}`` instead, one mode per checkpointed block (the
    budget mixes them); ``wrap`` then ignores ``select`` and ``context_fn``. A policy whose choice
    depends on how the model runs (a memory budget) adds the two hooks of :class:`PlannedPolicy`.
    """

    def select(self, candidates: Candidates) -> list[int]: ...


@runtime_checkable
class PlannedPolicy(Protocol):
    """A policy whose choice depends on how the model runs (parameters, gradients and optimizer state
    placed by the strategy), chosen on a profile of the model: :class:`Budget`, or a user's own.

    ``wrap`` plans it for ``plans_for(Parallelism(None, world_size))`` (nothing known yet: the policy
    says what it assumes) on ``example_inputs``, or, without them, on the first training forward's
    inputs. ``parallelize`` (and the Accelerate integration) then hand over the placement the model
    really runs under: ``plans_for(that)`` checks it (raising when the policy contradicts it), and when
    it differs from what the choice was planned for, ``wrap`` plans ``placed(that)`` again. The
    state in between is the model's :class:`~distckpt.apply.state.WrapState`.
    """

    def plans_for(self, known: Parallelism) -> Parallelism:
        """The placement this policy plans for, given what is known (``known.strategy`` None: nothing yet).

        Raises:
            ConfigError: the policy contradicts ``known``.
        """
        ...

    def placed(self, parallelism: Parallelism) -> Policy:
        """This policy planning for exactly ``parallelism``."""
        ...

    def select(self, candidates: Candidates) -> list[int]: ...


def is_planned(policy: Policy | None) -> bool:
    """Whether ``policy`` is a :class:`PlannedPolicy` (it has both hooks)."""
    return callable(getattr(policy, "plans_for", None)) and callable(getattr(policy, "placed", None))


@dataclass(frozen=True)
class Full:
    """Checkpoint every block."""

    def select(self, candidates: Candidates) -> list[int]:
        return list(range(len(candidates.blocks)))


@dataclass(frozen=True)
class EveryN:
    """Checkpoint blocks 0, N, 2N, ... (``every:1`` is ``full``)."""

    n: int

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ConfigError(f"every:N needs an integer N >= 1, got {self.n!r}. Valid forms: {SPEC_FORMS}.")

    def select(self, candidates: Candidates) -> list[int]:
        return list(range(0, len(candidates.blocks), self.n))


@dataclass(frozen=True)
class FirstN:
    """Checkpoint the first N blocks in forward order (all of them when N exceeds the count)."""

    n: int

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n < 0:
            raise ConfigError(f"first:N needs an integer N >= 0, got {self.n!r}. Valid forms: {SPEC_FORMS}.")

    def select(self, candidates: Candidates) -> list[int]:
        return list(range(min(self.n, len(candidates.blocks))))


@dataclass(frozen=True)
class Fraction:
    """Checkpoint ``round(F * n)`` of the n blocks, spread evenly over the depth."""

    f: float

    def __post_init__(self) -> None:
        if not isinstance(self.f, (int, float)) or not math.isfinite(self.f) or not 0.0 <= self.f <= 1.0:
            raise ConfigError(f"fraction:F needs 0 <= F <= 1, got {self.f!r}. Valid forms: {SPEC_FORMS}.")

    def select(self, candidates: Candidates) -> list[int]:
        n = len(candidates.blocks)
        k = round(self.f * n)
        # Centre of each of k equal slices of the depth: fraction:0.5 of 8 blocks -> 1, 3, 5, 7.
        return sorted({min(n - 1, int((i + 0.5) * n / k)) for i in range(k)}) if k else []


@dataclass(frozen=True)
class Budget:
    """Checkpoint the fewest-recompute set of blocks whose peak training memory fits ``bytes``.

    ``bytes=None`` means "auto": the free memory of the current CUDA device. ``strategy``
    (``"ddp"``, ``"fsdp"``, ``"fsdp2"``, ``"hsdp"`` with ``shard_size``, ``"none"``) says how
    parameters, gradients and optimizer state are placed; ``None`` (the default, and what
    ``"budget:SIZE"`` gives) means "the strategy ``parallelize`` uses": the plan made at ``wrap``
    (``"ddp"`` when a process group of several ranks exists, else ``"none"``) is redone there with
    the real strategy, world size and shard size. An explicit strategy that ``parallelize``
    contradicts is refused. ``optimizer`` (``"adamw"``, ``"sgd"``, ``"sgd_momentum"``, ...) says
    how much optimizer state to count; ``grad_accumulation=True`` counts gradients as present from
    the first forward (they persist across micro-batches). Each block gets none, ``pointwise``
    (op-level: keep every matmul/attention output, recompute only the FLOP-free ops), ``selective``
    (recompute every other matmul too) or full checkpointing (``selective=False``: none or full, and
    the profile skips the op-level sample steps) or, with ``per_op`` (the default), ``"ops"``: the outputs
    of exactly the matmul/attention calls that pay most for their bytes kept, the rest recomputed (a
    per-op choice inside the block, :class:`~distckpt.runtime.selective.KeepOps`). On CUDA a block may
    also be ``offload``ed (not recomputed; its saved tensors kept in pinned host memory) when asked for: priced at
    ``offload_flops_per_byte`` FLOPs per byte moved, or ``"auto"``: measured once per device (matmul
    FLOP/s over host-link bytes/s). ``None`` (the default, until offload has been measured on a GPU)
    and off CUDA: not offered. The selection itself lives in :mod:`distckpt.select.budget`. A
    :class:`PlannedPolicy`: ``parallelize`` hands it the strategy, ranks and shard size it runs under.
    """

    bytes: int | None
    strategy: str | None = None
    optimizer: str = "adamw"
    grad_accumulation: bool = False
    shard_size: int | None = None  # "hsdp": ranks per shard group (default: LOCAL_WORLD_SIZE)
    selective: bool = True  # offer the op-level modes (pointwise, selective) per block (False: none or full)
    per_op: bool = True  # with selective: offer the "ops" mode (which op calls' outputs a block keeps)
    # "offload" per block: its price in FLOPs per byte moved to the host and back, "auto" to measure it on CUDA;
    # None (default) or math.inf: not offered, not profiled. Off CUDA host memory is the step's own: not offered.
    offload_flops_per_byte: float | str | None = None

    def __post_init__(self) -> None:
        if self.bytes is not None and (not isinstance(self.bytes, int) or self.bytes <= 0):
            raise ConfigError(f"budget:SIZE needs a positive size, got {self.bytes!r}. Valid forms: {SPEC_FORMS}.")
        ratio = self.offload_flops_per_byte
        if (
            ratio is not None
            and ratio != "auto"
            and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or math.isnan(ratio) or ratio <= 0)
        ):
            raise ConfigError(
                f"Budget(offload_flops_per_byte=...) must be a positive number (FLOPs per byte moved "
                f"to the host and back) or 'auto' (measured on CUDA), got {ratio!r}; None or "
                "math.inf: offload not offered."
            )

    def strategy_for(self, world_size: int) -> str:
        """The strategy the plan assumes: the one given, else DDP with several ranks, else none."""
        if self.strategy is not None:
            return self.strategy
        return "ddp" if world_size > 1 else "none"

    def plans_for(self, known: Parallelism) -> Parallelism:
        """At ``wrap`` (``known.strategy`` None) the placement of :meth:`strategy_for` and this budget's
        ``shard_size``; once ``parallelize`` says, ``known`` itself.

        Raises:
            ConfigError: an explicit ``strategy`` or ``shard_size`` other than ``known``'s.
        """
        if known.strategy is None:
            return Parallelism(self.strategy_for(known.world_size), known.world_size, self.shard_size)
        strategy = known.strategy
        # FSDP2 over a 2-D mesh is HSDP: a plan for "fsdp2" is redone for its shard groups, not refused.
        if self.strategy is not None and self.strategy != strategy and (self.strategy, strategy) != ("fsdp2", "hsdp"):
            raise ConfigError(
                f"distckpt.wrap(model, Budget(..., strategy={self.strategy!r})) planned memory for {self.strategy}, "
                f"but parallelize uses {strategy!r} (which places parameters, gradients and optimizer state "
                f"differently). Pass strategy={strategy!r} to Budget, or leave it out (as budget:SIZE does) so the "
                "plan follows parallelize."
            )
        if self.shard_size is not None and known.shard_size is not None and self.shard_size != known.shard_size:
            raise ConfigError(
                f"Budget(shard_size={self.shard_size}) planned for shard groups of {self.shard_size} ranks, but "
                f"parallelize shards over {known.shard_size}. Pass the same shard_size to both, or leave it out of "
                "Budget."
            )
        return known

    def placed(self, parallelism: Parallelism) -> Budget:
        """This budget for exactly ``parallelism``: its strategy and shard size."""
        return dataclasses.replace(self, strategy=parallelism.strategy, shard_size=parallelism.shard_size)

    def plan(self, candidates: Candidates) -> Any:
        """The :class:`~distckpt.select.budget.BudgetPlan` for ``candidates`` (the op-level modes only where
        ``candidates.op_level``: not under reentrant checkpointing)."""
        from distckpt.select.budget import select_for_budget

        return select_for_budget(
            candidates,
            self.bytes,
            strategy=self.strategy_for(candidates.world_size),
            optimizer=self.optimizer,
            grad_accumulation=self.grad_accumulation,
            shard_size=self.shard_size,
            selective=self.selective and candidates.op_level,
            offload_flops_per_byte=self.offload_flops_per_byte,
            per_op=self.per_op,
        )

    def select(self, candidates: Candidates) -> list[int]:
        return list(self.plan(candidates).selected)

    def modes(self, candidates: Candidates) -> dict[int, str | KeepOps]:
        """``{index: "pointwise" | "selective" | "full" | "offload" | KeepOps}`` for the blocks to checkpoint."""
        plan = self.plan(candidates)
        return {i: plan.mode_of(i) for i in plan.selected}


@dataclass(frozen=True)
class Selective:
    """Op-level checkpointing inside every block: keep the outputs of expensive ops
    (matmuls, attention) and recompute the cheap pointwise ones.

    ``save_ops`` overrides the default list of ops whose outputs are kept (aten ops or names);
    ``every_other_matmul=False`` keeps every matmul output instead of every other one (with the
    default ops: the ``pointwise`` mode, which recomputes only ops that count no FLOPs).
    """

    save_ops: tuple[Any, ...] | None = None
    every_other_matmul: bool = True

    def select(self, candidates: Candidates) -> list[int]:
        return list(range(len(candidates.blocks)))

    def context_fn(self) -> Callable[[], tuple[Any, Any]]:
        from distckpt.runtime.selective import selective_context_fn

        return selective_context_fn(self.save_ops, self.every_other_matmul)


@dataclass(frozen=True)
class Placement:
    """Checkpoint each block in the mode given for it: ``"none"``, ``"pointwise"``, ``"selective"``,
    ``"full"``, ``"offload"`` (:data:`CHECKPOINT_MODES`) or a :class:`~distckpt.runtime.selective.KeepOps`
    (the ``"ops"`` mode: the outputs of the op calls it names kept).

    ``choice`` holds one mode per candidate block (in forward order), or ``{fqn: mode}`` (blocks not
    named: none). It is how a benchmark or a test places mixed modes by hand, as a budget plan does.
    """

    choice: tuple[str | KeepOps, ...] | dict[str, str | KeepOps]

    def __post_init__(self) -> None:
        values = self.choice.values() if isinstance(self.choice, dict) else self.choice
        named = [m for m in CHECKPOINT_MODES if m != KEEP_MODE]
        bad = sorted({repr(m) for m in values if not isinstance(m, KeepOps) and m not in named})
        if bad:
            raise ConfigError(
                f"Placement modes must be among {', '.join(map(repr, named))} or a KeepOps (the ops mode), got {bad}."
            )

    def select(self, candidates: Candidates) -> list[int]:
        return sorted(self.modes(candidates))

    def modes(self, candidates: Candidates) -> dict[int, str | KeepOps]:
        """``{index: mode}`` for the blocks to checkpoint (every mode but none).

        Raises:
            ConfigError: a tuple of modes whose length is not the number of candidate blocks.
        """
        n = len(candidates.blocks)
        if isinstance(self.choice, dict):
            every = [self.choice.get(name, "none") for name, _ in candidates.blocks]
        elif len(self.choice) != n:
            raise ConfigError(f"Placement has {len(self.choice)} modes for {n} candidate blocks; give one per block.")
        else:
            every = list(self.choice)
        return {i: m for i, m in enumerate(every) if m != "none"}


_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kb": 10**3,
    "kib": 2**10,
    "m": 2**20,
    "mb": 10**6,
    "mib": 2**20,
    "g": 2**30,
    "gb": 10**9,
    "gib": 2**30,
    "t": 2**40,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_size(text: str | int) -> int:
    """Parse ``"2GiB"``, ``"512MB"``, ``"1.5G"`` or a plain byte count into bytes.

    Raises:
        ConfigError: when the text is not a positive size.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text > 0:
            return text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        if m and m.group(2).lower() in _UNITS:
            value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
            if value > 0:
                return value
    raise ConfigError(f"{text!r} is not a size; write bytes or a number with KiB/MiB/GiB (e.g. 2GiB, 512MiB).")


def parse_policy(spec: str | Policy | None) -> Policy | None:
    """Turn a spec string (or a policy object, or ``None``) into a policy object or ``None``.

    Raises:
        ConfigError: naming the valid forms when ``spec`` is not one of them.
    """
    if spec is None:
        return None
    if not isinstance(spec, str):
        if isinstance(spec, Policy):
            return spec
        raise ConfigError(
            f"policy must be a spec string or a policy object, got {type(spec).__name__}. Valid forms: {SPEC_FORMS}."
        )
    text = spec.strip().lower()
    name, _, arg = text.partition(":")
    try:
        if name == "none" and not arg:
            return None
        if name == "full" and not arg:
            return Full()
        if name == "selective" and not arg:
            return Selective()
        if name == "every" and arg:
            return EveryN(int(arg))
        if name == "first" and arg:
            return FirstN(int(arg))
        if name == "fraction" and arg:
            return Fraction(float(arg))
        if name == "budget" and arg:
            return Budget(None if arg == "auto" else parse_size(spec.strip()[len("budget:") :]))
    except ValueError as e:  # int("x"), float("x"), a bad size, or a ConfigError from a constructor
        if isinstance(e, ConfigError) and "Valid forms" in str(e):
            raise
        raise ConfigError(f"bad checkpoint policy {spec!r} ({e}). Valid forms: {SPEC_FORMS}.") from None
    raise ConfigError(f"unknown checkpoint policy {spec!r}. Valid forms: {SPEC_FORMS}.")


def select_blocks(policy: Policy, candidates: Candidates) -> list[int]:
    """Run ``policy.select`` and check what it returned (an internal invariant)."""
    chosen = sorted(set(policy.select(candidates)))
    assert all(0 <= i < len(candidates.blocks) for i in chosen), chosen
    return chosen
