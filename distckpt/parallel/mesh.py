"""Device meshes for ``parallelize``: the layout a strategy and an optional user mesh describe, and the mesh it runs
on: the 1-D mesh of plain data parallelism, the 2-D ``("replicate", "shard")`` mesh of HSDP (FSDP2 shards within
a group of ``shard_size`` ranks, usually a node, and all-reduces across the groups: ``fully_shard`` does this natively
given a 2-D mesh), or the ``"dp"`` dimension of a ``("dp", "tp")`` mesh whose ``"tp"`` dimension the model's
tensor-parallel parameters already live on."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from distckpt.errors import ConfigError
from distckpt.layout import DP_DIM, HSDP_DIMS, TP_DIM, Layout
from distckpt.options import Engine, engine_of

__all__ = ["HSDP_DIMS", "build_mesh", "check_mesh", "mesh_group", "resolve_layout"]

TP_DIMS = (DP_DIM, TP_DIM)
_HOW_TP = (
    "Build the mesh with init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=('dp', 'tp')), apply "
    "parallelize_module(model, mesh['tp'], plan), then parallelize(model, 'fsdp2', device_mesh=mesh)."
)

_HOW = (
    "Build it with torch.distributed.device_mesh.init_device_mesh(device_type, (world // N, N), "
    "mesh_dim_names=('replicate', 'shard')), or let distckpt build it: parallelize(model, 'hsdp', shard_size=N)."
)


def build_mesh(layout: Layout, device_type: str) -> Any:
    """The mesh of ``layout`` when it needs one built (HSDP's ``(world // shard_size, shard_size)`` mesh named
    ``("replicate", "shard")``; with tensor parallel ``(dp, tp)`` named ``("dp", "tp")``: apply tensor parallel over
    its ``"tp"`` dimension, then pass it to ``parallelize``), else None (DDP/FSDP/FSDP2 run on the default group)."""
    if layout.shard_size is None and layout.tp == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    names, shape = zip(*layout.mesh_dims)
    return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))


def check_mesh(mesh: Any, engine: Engine) -> None:
    """Refuse a mesh ``parallelize`` cannot use for ``engine``: any but a 1-D one or a 2-D
    ``("replicate", "shard")`` one spanning every rank (FSDP1: 1-D only).

    Raises:
        ConfigError: naming the mesh to build instead.
    """
    if mesh is None or mesh.ndim == 1:
        return
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim == 2 and names == TP_DIMS:
        return  # tensor parallel: resolve_layout checks it against the model
    if mesh.ndim != 2 or names != HSDP_DIMS:
        raise ConfigError(
            f"parallelize takes a 1-D device_mesh, a 2-D one named {HSDP_DIMS} (HSDP) or {TP_DIMS} (tensor parallel), "
            f"got a {mesh.ndim}-D mesh named {names or None}. {_HOW}"
        )
    if engine is Engine.FSDP1:
        raise ConfigError(
            "strategy='fsdp' (FSDP1) takes a 1-D device_mesh only; for HSDP over a 2-D mesh use "
            "strategy='fsdp2' with the mesh, or strategy='hsdp' with shard_size=N."
        )
    if mesh.size() != dist.get_world_size():
        raise ConfigError(
            f"the 2-D device_mesh spans {mesh.size()} of the {dist.get_world_size()} ranks; distckpt syncs its "
            f"bookkeeping over the whole world, so the mesh must span every rank. {_HOW}"
        )


def mesh_group(mesh: Any) -> Any:
    """The process group of the data-parallel ranks: a 1-D mesh's group, the world for a 2-D mesh
    (every rank trains on its own data shard, whichever dimension it sits on), or None (the world)."""
    if mesh is None or mesh.ndim != 1:
        return None
    return mesh.get_group()


def _tp_layout(strategy: str, device_mesh: Any, tp_mesh: Any, compile: Any) -> tuple[Layout, Any]:
    """The layout of a tensor-parallel model (its parameters on ``tp_mesh``) and its data-parallel mesh: the ``"dp"``
    dimension of a ``("dp", "tp")`` mesh, or a 1-D mesh of the data-parallel ranks (``mesh["dp"]``).

    Raises:
        ConfigError: no mesh, a mesh of other names or sizes than the model's tensor-parallel mesh, a strategy other
            than fsdp2, or a ``"tp"`` dimension while no parameter is tensor-parallel.
    """
    world = dist.get_world_size()
    if tp_mesh is None:  # a ("dp", "tp") mesh for a model nobody made tensor-parallel
        raise ConfigError(f"device_mesh has a 'tp' dimension, but no parameter of the model is a DTensor. {_HOW_TP}")
    tp = tp_mesh.size()
    if device_mesh is None or (device_mesh.ndim == 2 and tuple(device_mesh.mesh_dim_names or ()) != TP_DIMS):
        raise ConfigError(
            f"the model is tensor-parallel over {tp} ranks: parallelize needs its data-parallel ranks, "
            f"device_mesh=mesh (named {TP_DIMS}) or device_mesh=mesh['dp']. {_HOW_TP}"
        )
    if device_mesh.ndim == 2:
        if device_mesh[TP_DIM].mesh.tolist() != tp_mesh.mesh.tolist():
            raise ConfigError(
                f"device_mesh['tp'] holds ranks {device_mesh[TP_DIM].mesh.tolist()} but the model's tensor-parallel "
                f"parameters live on ranks {tp_mesh.mesh.tolist()}: pass the mesh whose 'tp' dimension you applied "
                "parallelize_module over."
            )
        device_mesh = device_mesh[DP_DIM]
    if device_mesh.size() * tp != world or set(device_mesh.mesh.tolist()) & set(tp_mesh.mesh.tolist()) != {
        dist.get_rank()
    }:
        raise ConfigError(
            f"device_mesh (ranks {device_mesh.mesh.tolist()}) is not the data-parallel dimension of the model's "
            f"tensor-parallel mesh (ranks {tp_mesh.mesh.tolist()}) over {world} ranks. {_HOW_TP}"
        )
    return Layout.of(strategy, world_size=device_mesh.size(), compile=compile, tp=tp), device_mesh


def resolve_layout(
    strategy: str | Layout,
    device_mesh: Any,
    shard_size: int | None,
    compile: Any,
    device_type: str,
    tp_mesh: Any = None,
) -> tuple[Layout, Any]:
    """The checked layout of ``parallelize(model, strategy, device_mesh=, shard_size=, compile=)`` and the mesh it
    runs on (None: the default group). FSDP2 given a 2-D ``("replicate", "shard")`` mesh is HSDP, and its layout
    says so (the memory plan places parameters by shard group). A tensor-parallel model (``tp_mesh``: the mesh of
    its DTensor parameters) runs FSDP2 over the ``"dp"`` dimension of a ``("dp", "tp")`` mesh.

    Raises:
        ConfigError: ``shard_size`` without ``"hsdp"``, ``"hsdp"`` with a 1-D mesh or with both a mesh and a
            shard size, a :class:`Layout` made for another world, shard or tensor-parallel size, a mesh
            :func:`check_mesh` refuses, or a tensor-parallel model without its data-parallel mesh or under
            another strategy than fsdp2.
    """
    given = strategy if isinstance(strategy, Layout) else None
    if given is not None:
        Layout.of(given, shard_size=shard_size, compile=compile)  # refuses options given twice
        strategy, shard_size, compile = given.strategy, given.shard_size, given.compile
    elif strategy == "hsdp" and device_mesh is not None and shard_size is not None:
        raise ConfigError(
            "strategy='hsdp' got both device_mesh= and shard_size=: pass one (the mesh already says the shard size)."
        )
    engine = engine_of(strategy)
    if engine is Engine.NONE:
        if tp_mesh is not None:
            raise ConfigError(f"strategy='none' got a tensor-parallel model. {_HOW_TP}")
        return Layout.of(strategy, shard_size=shard_size, compile=compile), None
    world = dist.get_world_size()
    if device_mesh is not None:
        check_mesh(device_mesh, engine)
    tp_dims = device_mesh is not None and tuple(device_mesh.mesh_dim_names or ()) == TP_DIMS
    if tp_mesh is not None or tp_dims:
        if shard_size is not None:
            raise ConfigError(f"shard_size= (HSDP) does not combine with tensor parallel here. {_HOW_TP}")
        layout, device_mesh = _tp_layout(strategy, device_mesh, tp_mesh, compile)
    elif device_mesh is None:
        layout = Layout.of(strategy, world_size=world, shard_size=shard_size, compile=compile)
    elif device_mesh.ndim == 2 and engine is Engine.FSDP2:
        layout = Layout.of("hsdp", world_size=world, shard_size=device_mesh.size(1), compile=compile)
    elif device_mesh.ndim == 2:  # DDP replicates over the whole 2-D mesh: the world (checked)
        layout = Layout.of(strategy, world_size=world, compile=compile)
    elif strategy == "hsdp":
        raise ConfigError(f"strategy='hsdp' needs a 2-D device_mesh named {HSDP_DIMS}, got a 1-D one. {_HOW}")
    else:
        layout = Layout.of(strategy, world_size=device_mesh.size(), compile=compile)
    if given is not None and (
        given.world_size != layout.world_size
        or given.shard_size not in (None, layout.shard_size)
        or given.tp != layout.tp
    ):
        raise ConfigError(
            f"the Layout says {given.describe()}, but parallelize runs {layout.describe()}: build the Layout for "
            "this job (Layout.of(strategy, world_size=dist.get_world_size(), ...)), or pass the strategy name."
        )
    return layout, (device_mesh if device_mesh is not None else build_mesh(layout, device_type))
