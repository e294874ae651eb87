"""How a model runs across ranks, as one typed value: the strategy, the mesh's named dimensions, the HSDP shard
size and the per-block compile options. Built and validated once, at the boundary (``parallelize``'s arguments,
the launcher's ``strategy`` group, ``distckpt plan``), and read everywhere else: no module below the boundary
tests a strategy string. A new kind of parallelism (a tensor-parallel or pipeline dimension) is one more field here.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from distckpt.errors import ConfigError
from distckpt.options import Engine, check_shard_size, check_strategy, check_tp, engine_of

__all__ = ["CompileOptions", "Engine", "Layout", "compile_options", "default_shard_size"]


# The mesh FSDP2 turns into HSDP: reduce-scatter within "shard" (a node), all-reduce across "replicate".
HSDP_DIMS = ("replicate", "shard")
DP_DIM = "dp"
TP_DIM = "tp"  # the mesh dimension a model's tensor-parallel parameters are sharded over


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """The arguments of ``torch.compile`` for each block (hashable: one compiled function per set of options).

    ``fullgraph=True`` (as torchtitan compiles its blocks): a block that dynamo cannot trace in one graph raises
    :class:`ConfigError` at its first forward instead of running in pieces between graph breaks.
    """

    backend: str = "inductor"
    fullgraph: bool = True
    dynamic: bool | None = None
    mode: str | None = None
    options: tuple[tuple[str, Any], ...] = ()

    def kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"backend": self.backend, "fullgraph": self.fullgraph, "dynamic": self.dynamic}
        if self.mode is not None:
            out["mode"] = self.mode
        if self.options:
            out["options"] = dict(self.options)
        return out


_KEYS = tuple(f.name for f in dataclasses.fields(CompileOptions))


def compile_options(spec: Any) -> CompileOptions | None:
    """``parallelize``'s ``compile=``: ``None``/``False`` (no compile), ``True`` (the defaults), a mapping of
    ``torch.compile`` arguments (``{"backend": "aot_eager", "fullgraph": False}``) or a :class:`CompileOptions`.

    Raises:
        ConfigError: another type, or a key ``torch.compile`` takes that is not per block (``model``) or unknown.
    """
    if spec is None or spec is False:
        return None
    if spec is True:
        return CompileOptions()
    if isinstance(spec, CompileOptions):
        return spec
    if not isinstance(spec, Mapping):
        raise ConfigError(
            f"compile= takes True, False, or a dict of torch.compile arguments (backend, fullgraph, dynamic, mode, "
            f"options), got {type(spec).__name__}."
        )
    bad = sorted(set(spec) - set(_KEYS))
    if bad:
        raise ConfigError(
            f"compile= got unknown keys {bad}; each block is compiled with torch.compile({', '.join(_KEYS)})."
        )
    kw = dict(spec)
    if kw.get("options") is not None:
        kw["options"] = tuple(sorted(dict(kw["options"]).items()))
    else:
        kw.pop("options", None)
    opts = CompileOptions(**kw)
    try:
        hash(opts)
    except TypeError:
        raise ConfigError(
            f"compile= options must have hashable values (numbers, strings, booleans, tuples), got {spec['options']}."
        ) from None
    return opts


def default_shard_size(fallback: int | None = None) -> int | None:
    """HSDP's shard group when none is given: the ranks of one node (``LOCAL_WORLD_SIZE``, set by torchrun); without
    it, ``fallback`` (the launcher's: the whole job, one node, before torchrun starts)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if local else fallback


@dataclasses.dataclass(frozen=True)
class Layout:
    """The parallel layout of a run. Construct it with :meth:`of` (checked); the fields are plain data.

    Args:
        strategy: ``"none"``, ``"ddp"``, ``"fsdp"`` (FSDP1), ``"fsdp2"`` or ``"hsdp"`` (FSDP2 over a
            ``("replicate", "shard")`` mesh). FSDP2 given a 2-D mesh of those names *is* HSDP and is stored so.
        world_size: the data-parallel ranks (each trains on its own shard of the batch).
        shard_size: ranks that shard the parameters between them under ``"hsdp"`` (a node); None otherwise.
        compile: each block compiled with these options before sharding, or None.
        tp: tensor-parallel ranks per data-parallel rank (the ``"tp"`` dimension of a ``("dp", "tp")`` mesh; they
            see the same batch); the job runs ``world_size * tp`` ranks.
    """

    strategy: str = "none"
    world_size: int = 1
    shard_size: int | None = None
    compile: CompileOptions | None = None
    tp: int = 1

    @classmethod
    def of(
        cls,
        strategy: str | Layout = "ddp",
        *,
        world_size: int = 1,
        shard_size: int | None = None,
        compile: Any = None,
        tp: int | None = None,
    ) -> Layout:
        """The checked layout of ``strategy`` over ``world_size`` data-parallel ranks.

        Args:
            strategy: a strategy name, or a :class:`Layout` (returned as is; then nothing else may be given).
            world_size: data-parallel ranks.
            shard_size: ``"hsdp"`` only: ranks per shard group, dividing ``world_size`` (default:
                ``LOCAL_WORLD_SIZE``, the ranks of one node).
            compile: as :func:`compile_options`.
            tp: tensor-parallel ranks per data-parallel rank (``"fsdp2"`` only; default 1).

        Raises:
            ConfigError: an unknown strategy, ``shard_size`` without ``"hsdp"``, unknown or not dividing the world,
                ``tp`` above 1 under another strategy than ``"fsdp2"``, a Layout given together with other
                options, or bad compile options.
        """
        if isinstance(strategy, Layout):
            if shard_size is not None or compile is not None or tp is not None:
                raise ConfigError(
                    "parallelize got a Layout and shard_size=/compile=/tp= as well: the layout already says them. Pass "
                    "one: Layout.of(strategy, shard_size=..., compile=...), or the strategy name with the options."
                )
            return strategy
        if not isinstance(strategy, str):
            raise ConfigError(f"strategy must be a strategy name or a distckpt Layout, got {type(strategy).__name__}.")
        check_strategy(strategy)
        if strategy != "hsdp" and shard_size is not None:
            raise ConfigError(
                f"shard_size={shard_size} is for strategy='hsdp' (got {strategy!r}): remove it, or use strategy='hsdp'."
            )
        if strategy == "hsdp":
            shard_size = default_shard_size() if shard_size is None else shard_size
            if shard_size is None:
                raise ConfigError(
                    "strategy='hsdp' needs shard_size=N (the ranks of one node), or LOCAL_WORLD_SIZE set by torchrun: "
                    "pass parallelize(model, 'hsdp', shard_size=N)."
                )
            check_shard_size(shard_size, world_size)
        tp = 1 if tp is None else tp
        check_tp(tp, strategy)
        if strategy == "none":
            world_size = 1
        return cls(strategy, world_size, shard_size, compile_options(compile), tp)

    # --- what the rest of the library reads ---------------------------------------------------------

    @property
    def engine(self) -> Engine:
        return engine_of(self.strategy)

    @property
    def sharded(self) -> bool:
        """Parameters, gradients and optimizer state are sharded (FSDP1, FSDP2, HSDP)."""
        return self.engine.sharded

    @property
    def shards(self) -> int:
        """Ranks that share one copy of the parameters: HSDP's shard group, every rank under FSDP, 1 otherwise."""
        if self.shard_size is not None:
            return self.shard_size
        return self.world_size if self.sharded else 1

    @property
    def ranks(self) -> int:
        """The job's ranks: data-parallel times tensor-parallel."""
        return self.world_size * self.tp

    @property
    def mesh_dims(self) -> tuple[tuple[str, int], ...]:
        """The mesh as (name, size) pairs: ``(("dp", world),)``, HSDP's ``(("replicate", world // shard),
        ("shard", shard))``, with tensor parallel ``(("dp", world), ("tp", tp))``; ``()`` for one process."""
        if self.engine is Engine.NONE:
            return ()
        if self.shard_size is not None:
            return ((HSDP_DIMS[0], self.world_size // self.shard_size), (HSDP_DIMS[1], self.shard_size))
        if self.tp > 1:
            return ((DP_DIM, self.world_size), (TP_DIM, self.tp))
        return ((DP_DIM, self.world_size),)

    def describe(self) -> str:
        """``"hsdp over 4 ranks (mesh 2 replicate x 2 shard)"``, ``"fsdp2 over 2 ranks x tp 2 (mesh 2 dp x 2 tp)"``:
        for logs and messages."""
        if self.engine is Engine.NONE:
            return "one process"
        text = f"{self.strategy} over {self.world_size} rank{'s' if self.world_size != 1 else ''}"
        if self.shard_size is not None:
            text += f" (mesh {self.world_size // self.shard_size} replicate x {self.shard_size} shard)"
        if self.tp > 1:
            text += f" x tp {self.tp} (mesh {self.world_size} dp x {self.tp} tp)"
        return text
