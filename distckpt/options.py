"""Run-level options and the rules that combine them: the one place that says which strategies,
graphs and optimizers exist and which combinations distckpt refuses. ``parallelize``,
``accumulate``, the budget planner, the ``distckpt`` command and the launcher's config validation
all read it, so they cannot disagree."""

from __future__ import annotations

import enum
import warnings

from distckpt.errors import ConfigError

__all__ = [
    "Engine",
    "GRAPHS",
    "OPTIMIZERS",
    "SHARDED",
    "STRATEGIES",
    "check_graph",
    "check_run",
    "check_shard_size",
    "check_strategy",
    "check_tp",
    "engine_of",
]

STRATEGIES = ("none", "ddp", "fsdp", "fsdp2", "hsdp")
# The strategies that shard parameters, gradients and optimizer state. "hsdp" is FSDP2 over a 2-D mesh
# ("replicate", "shard"): sharded within a group of shard_size ranks (a node), replicated across groups.
SHARDED = ("fsdp", "fsdp2", "hsdp")
# "dynamic" is a deprecated alias of "auto" (any used set, by step or rank): check_graph warns.
GRAPHS = ("auto", "static", "dynamic")
OPTIMIZERS = ("adamw", "sgd")  # the optimizers whose state the budget planner counts


class Engine(enum.Enum):
    """What builds the parallel model (a strategy names one; ``"hsdp"`` is FSDP2 over a 2-D mesh). The library
    tests engines, never strategy strings: a strategy name is read once, at the boundary (``distckpt.layout``)."""

    NONE = "none"
    DDP = "ddp"
    FSDP1 = "fsdp"
    FSDP2 = "fsdp2"

    @property
    def sharded(self) -> bool:
        return self in (Engine.FSDP1, Engine.FSDP2)


def engine_of(strategy: str) -> Engine:
    """The engine of a strategy name (checked)."""
    check_strategy(strategy)
    return Engine.FSDP2 if strategy == "hsdp" else Engine(strategy)


def check_strategy(strategy: str) -> None:
    """Raises ConfigError for an unknown strategy."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy must be one of {STRATEGIES}, got {strategy!r}.")


def check_shard_size(shard_size: object, world_size: int) -> None:
    """Raises ConfigError unless ``shard_size`` (ranks per shard group under ``"hsdp"``) divides the world.

    Args:
        shard_size: ranks that shard the parameters between them (usually the ranks of one node).
        world_size: ranks of the job.
    """
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ConfigError(f"hsdp shard_size must be a positive int (the ranks of one node), got {shard_size!r}.")
    if world_size % shard_size:
        raise ConfigError(
            f"hsdp shard_size={shard_size} does not divide the world size {world_size}: the mesh is "
            f"(world // shard_size, shard_size). Use a shard_size that divides {world_size}, usually the ranks "
            "per node (LOCAL_WORLD_SIZE)."
        )


def check_tp(tp: object, strategy: str, world_size: int | None = None) -> None:
    """Raises ConfigError unless ``tp`` (tensor-parallel ranks per data-parallel replica) can run: a positive int,
    above 1 only under ``"fsdp2"``, and dividing ``world_size`` (the job's ranks) when given.

    Why fsdp2 only (torch 2.13, measured): DDP's own TP route (``_pre_dp_module_transform``) turns the
    tensor-parallel parameters into plain attributes after the first forward (14 of 16 ``state_dict`` entries of a
    dp=2 x tp=2 model gone); FSDP1 and HSDP over a third mesh dimension are not tested here.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tp must be a positive int (tensor-parallel ranks per replica), got {tp!r}.")
    if tp > 1 and strategy != "fsdp2":
        raise ConfigError(
            f"tensor parallel (tp={tp}) runs with strategy='fsdp2' only (FSDP2 over the 'dp' dimension of a "
            f"('dp', 'tp') mesh), got {strategy!r}: DDP's own tensor-parallel route drops the tensor-parallel "
            "parameters from the model after the first forward. Use strategy='fsdp2', or tp=1."
        )
    if world_size is not None and world_size % tp:
        raise ConfigError(
            f"tp={tp} does not divide the {world_size} ranks: the mesh is (world // tp data-parallel, tp). Use a "
            f"tp that divides {world_size} (usually the GPUs of one node or fewer)."
        )


def check_graph(graph: str) -> None:
    """Raises ConfigError for an unknown graph setting; warns that ``"dynamic"`` is deprecated."""
    if graph not in GRAPHS:
        raise ConfigError(f"graph must be one of {GRAPHS}, got {graph!r}.")
    if graph == "dynamic":
        warnings.warn(
            "graph='dynamic' is an alias of graph='auto' (any used parameters, by step or rank) and will "
            "be removed; use graph='auto'.",
            FutureWarning,
            stacklevel=3,
        )


def reentrant_refusal(engine: Engine) -> str | None:
    """Why ``engine`` cannot run reentrant-checkpointed blocks, or None."""
    if engine is Engine.FSDP1:
        return (
            "reentrant checkpointing under FSDP1 is not supported by distckpt: FSDP reduces a unit's flat "
            "gradient from a hook that a reentrant block's nested backward fires on its own. Use "
            "distckpt.wrap(..., reentrant=False), or strategy='fsdp2'."
        )
    return None


def accumulate_refusal(engine: Engine, *, reentrant: bool, graph: str) -> str | None:
    """Why gradient accumulation (``distckpt.accumulate``) cannot run with these settings, or None."""
    if engine is Engine.DDP and (reentrant or graph == "static"):
        # DDP's static graph (set for both) asserts inside its reducer when a step skips sync.
        why = "reentrant checkpointing" if reentrant else "graph='static'"
        return (
            f"gradient accumulation cannot skip sync under DDP static_graph=True (set for {why}). Use "
            "distckpt.wrap(..., reentrant=False) and graph='auto', or accumulate by summing the micro-batch "
            "losses before one backward."
        )
    return None


def check_run(strategy: str, *, reentrant: bool = False, graph: str = "auto", accumulate: bool = False) -> None:
    """Refuse a combination of run settings that distckpt cannot make right, whatever the model.

    Args:
        strategy: ``"none"``, ``"ddp"``, ``"fsdp"``, ``"fsdp2"`` or ``"hsdp"`` (FSDP2's rules).
        reentrant: blocks checkpointed with ``reentrant=True``.
        graph: ``"auto"``, ``"static"`` or ``"dynamic"``.
        accumulate: gradient accumulation with ``distckpt.accumulate`` (more than one micro-batch).

    Raises:
        ConfigError: naming the setting to change.
    """
    engine = engine_of(strategy)
    check_graph(graph)
    why = (reentrant and reentrant_refusal(engine)) or (
        accumulate and accumulate_refusal(engine, reentrant=reentrant, graph=graph)
    )
    if why:
        raise ConfigError(why)
