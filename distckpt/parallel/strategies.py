"""parallelize / ddp_kwargs / preflight / accumulate: DDP, FSDP and FSDP2 around checkpointed blocks,
with gradients equal to a single-process run for every multi-task pattern (see distckpt.parallel.param_sync)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from distckpt import _torch_compat as compat
from distckpt.apply.compile import apply_compile, compile_options, compiled_blocks
from distckpt.apply.state import candidate_blocks, pending_plan
from distckpt.apply.wrap import hand_over, parallel_kind
from distckpt.errors import ConfigError
from distckpt.options import SHARDED, accumulate_refusal, check_graph, check_strategy, reentrant_refusal
from distckpt.parallel.mesh import mesh_group, resolve_mesh
from distckpt.parallel.param_sync import SyncState, _Unit, param_owner
from distckpt.runtime.swap import _clean_fqn, is_checkpointed
from distckpt.select import Parallelism, conditional_reason

__all__ = ["accumulate", "attach_ddp", "ddp_kwargs", "parallelize", "preflight"]

_STATE = "_distckpt_sync"  # attribute of the returned model holding its SyncState


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reentrant_blocks(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if is_checkpointed(m) and m._distckpt_options.reentrant]


# --- DDP ----------------------------------------------------------------------------------------


def ddp_kwargs(model: nn.Module, *, graph: str = "auto") -> dict[str, Any]:
    """DDP flags for users who construct ``DistributedDataParallel`` themselves.

    Flags alone cannot make every pattern right (docs/parallel.md): ``parallelize`` also joins
    unused parameters with zero weight. These are the best flags without it: ``static`` ->
    ``static_graph=True``; ``auto``/``dynamic`` -> ``find_unused_parameters=True`` with
    non-reentrant blocks (not two forwards that use different heads before one backward).

    Args:
        model: the model after ``distckpt.apply.wrap``.
        graph: ``"auto"``, ``"static"`` or ``"dynamic"``.

    Returns:
        keyword arguments for ``DistributedDataParallel``.

    Raises:
        ConfigError: reentrant blocks with a graph that may change (no DDP flags are safe for it).
    """
    check_graph(graph)
    if graph == "static":
        return {"find_unused_parameters": False, "static_graph": True}
    if _reentrant_blocks(model):
        raise ConfigError(
            f"no DDP flags keep reentrant checkpointing correct when the graph may change (graph={graph!r}): "
            "find_unused_parameters breaks it and static_graph needs the same graph every step. Use "
            "distckpt.wrap(..., reentrant=False), or graph='static' if every step uses the same parameters."
        )
    return {"find_unused_parameters": True, "static_graph": False}


def _ddp_flags(kwargs: dict[str, Any], graph: str, reentrant: bool) -> dict[str, Any]:
    if kwargs.get("find_unused_parameters"):
        raise ConfigError(
            "find_unused_parameters=True is not needed with distckpt.parallelize (unused parameters join the "
            "graph with weight zero) and breaks two forwards before one backward and reentrant checkpointing. "
            "Remove it (distckpt.ddp_kwargs gives it only for a DDP you build yourself, without that join)."
        )
    want_static = graph == "static" or reentrant
    if "static_graph" in kwargs and bool(kwargs["static_graph"]) != want_static:
        why = (
            (
                "graph='static' needs it"
                if graph == "static"
                else "reentrant blocks need it (each block's gradients arrive in a nested backward)"
            )
            if want_static
            else f"graph={graph!r} says the used parameters may change between steps"
        )
        raise ConfigError(
            f"static_graph={kwargs['static_graph']} contradicts the setup: {why}. Remove static_graph and let "
            "distckpt choose."
        )
    return {**kwargs, "find_unused_parameters": False, "static_graph": want_static}


# --- parallelize --------------------------------------------------------------------------------


def parallelize(
    model: nn.Module, strategy: str = "ddp", *, graph: str = "auto", device_mesh: Any = None, **kwargs: Any
) -> nn.Module:
    """Wrap a model whose blocks ``distckpt.apply.wrap`` checkpointed in DDP, FSDP or FSDP2, correctly.

    Order (fixed): checkpointing is already inside the blocks; FSDP wraps each block (checkpointed
    or not; ``use_orig_params=True``) then the root; FSDP2 ``fully_shard``s each block, then
    the root; DDP wraps the root. Then every unit's forward gets the zero-weight join of its
    parameters, and the end of backward resets the grads of parameters no rank used to None.

    Args:
        model: the model, after ``distckpt.apply.wrap``.
        strategy: ``"ddp"``, ``"fsdp"`` (FSDP1), ``"fsdp2"`` (``fully_shard``), ``"hsdp"`` (``fully_shard``
            over a 2-D ``("replicate", "shard")`` mesh: sharded within ``shard_size`` ranks, replicated
            across those groups) or ``"none"``.
        graph: ``"auto"`` and ``"dynamic"``: any pattern (unused params joined with weight zero);
            ``"static"``: the same params every step and rank (DDP ``static_graph=True``, no join),
            checked each step.
        device_mesh: a 1-D DeviceMesh for FSDP2/FSDP/DDP (default: the world), or a 2-D one named
            ``("replicate", "shard")`` spanning every rank: FSDP2 (and ``"hsdp"``) then apply HSDP, DDP
            replicates over all its ranks.
        shard_size: ``"hsdp"`` only (a keyword in ``kwargs``): ranks per shard group, dividing the world
            size (default: ``LOCAL_WORLD_SIZE``, the ranks of one node); distckpt builds the mesh.
        **kwargs: passed to DDP / FSDP / ``fully_shard`` (mixed precision, ``bucket_cap_mb``, ...).

    Returns:
        the parallel model (DDP or FSDP wrapper; for FSDP2 the model itself).

    Raises:
        ConfigError: unknown strategy or graph, no process group, a model already wrapped, a mesh of
            another shape (the message says how to build one), or a kwarg that contradicts what
            correctness needs.
    """
    check_graph(graph)
    check_strategy(strategy)
    compiled = compile_options(kwargs.pop("compile", None))
    if strategy == "none":
        hand_over(model, Parallelism("none"))
        return model if compiled is None else apply_compile(model, compiled)
    shard_size = kwargs.pop("shard_size", None)
    _refuse_unready(model, strategy)
    device_mesh = resolve_mesh(strategy, device_mesh, shard_size, _device().type)
    # The hand-over point: a budget is planned for the strategy and mesh used here (before any unit exists).
    hand_over(model, _placement(strategy, device_mesh))
    strategy = "fsdp2" if strategy == "hsdp" else strategy  # HSDP is FSDP2 on the 2-D mesh
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    owners = [param_owner(model, n) for n in names]
    re_idx = _reentrant_params(model, names)
    if re_idx and reentrant_refusal(strategy):
        raise ConfigError(reentrant_refusal(strategy))

    # The order is fixed: checkpointing already sits inside the blocks (distckpt.wrap); then (compile=) each block is
    # compiled, checkpoint included; then FSDP/FSDP2 wrap each block (wrap's candidates, checkpointed or not) and the
    # root last, or DDP wraps the root. Their hooks stay outside the compiled code.
    if compiled is not None:
        apply_compile(model, compiled)
    if strategy == "ddp":
        reentrant = bool(_reentrant_blocks(model))
        wrapped, group = _apply_ddp(model, graph, reentrant, device_mesh, kwargs)
        units = [(_ddp_unit(model, names, owners), False)]
    elif strategy == "fsdp":
        wrapped, units, group = _apply_fsdp(model, names, owners, device_mesh, kwargs)
    else:
        wrapped, units, group = _apply_fsdp2(model, names, owners, device_mesh, kwargs)

    compiled_idx: set[int] = set()
    if compiled is not None:
        blocks = compiled_blocks(model)
        compiled_idx = {i for i, n in enumerate(names) if any(n.startswith(b + ".") for b in blocks)}
    _attach_state(wrapped, names, re_idx, units, group, strategy=strategy, graph=graph, compiled=compiled_idx)
    return wrapped


def _attach_state(
    wrapped: nn.Module,
    names: list[str],
    re_idx: set[int],
    units: list[tuple[_Unit, bool]],
    group: Any,
    *,
    strategy: str,
    graph: str,
    compiled: set[int],
) -> SyncState:
    """Then every unit's forward makes all its parameters take part (distckpt.parallel.param_sync); the state is
    kept on ``wrapped`` (``_STATE``), where ``accumulate``, ``preflight`` and the integrations find it."""
    # DDP's static graph needs no such join; FSDP has no such flag, so graph='static' joins there too (a used set
    # that differs across ranks would otherwise desync its reduce-scatter before the check runs).
    mode = "static" if graph == "static" and strategy == "ddp" else "join"
    registered_by_name = {_clean_fqn(n): p for n, p in wrapped.named_parameters()}
    state = SyncState(
        names,
        [registered_by_name[n] for n in names],
        mode,
        group,
        strategy,
        re_idx,
        static_check=graph == "static",
        ddp=wrapped if strategy == "ddp" else None,
    )
    state.compiled = compiled
    for unit, prepend in units:
        state.attach(unit, prepend)
    if re_idx and strategy == "ddp":
        state.count_reentrant_firings([(i, state.registered[i]) for i in sorted(re_idx)])
    setattr(wrapped, _STATE, state)
    return state


def attach_ddp(ddp: nn.Module, *, graph: str = "auto", keep_buffer_sync: bool = False) -> SyncState:
    """Give a ``DistributedDataParallel`` that someone else built (Accelerate, HF Trainer) what ``parallelize``
    gives its own: the zero-weight join of unused parameters in every forward, the used-set checks, the firing
    counts of reentrant blocks and ``distckpt.accumulate``'s bookkeeping. Call it right after DDP is built,
    before its first forward.

    Args:
        ddp: a ``DistributedDataParallel`` around a model whose blocks ``distckpt.wrap`` checkpointed, built with
            ``find_unused_parameters=False`` and ``static_graph=True`` exactly for ``graph='static'`` or reentrant
            blocks (what ``parallelize`` sets).
        graph: as ``parallelize``'s.
        keep_buffer_sync: keep the DDP's buffer sync at every forward as built (the user chose it); otherwise it is
            turned off for a model without running statistics, as ``parallelize`` builds it
            (:func:`sync_buffers_each_forward`).

    Returns:
        the state, also kept on ``ddp``: ``distckpt.accumulate(ddp)`` and ``GradSyncGuard`` work as after
        ``parallelize``.

    Raises:
        ConfigError: not a DDP, distckpt's state already attached, DDP flags that contradict what correctness
            needs, or what ``preflight`` refuses.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    check_graph(graph)
    if not isinstance(ddp, DDP):
        raise ConfigError(
            f"distckpt attaches its gradient-sync state to a DistributedDataParallel only, got {type(ddp).__name__}. "
            "Use distckpt.parallelize(model, strategy) to build FSDP/FSDP2 with distckpt."
        )
    if getattr(ddp, _STATE, None) is not None:
        raise ConfigError(
            "this DistributedDataParallel already has distckpt's gradient-sync state (built by distckpt.parallelize, "
            "or attached before). Attach it once, to a DDP built around the plain model."
        )
    model = ddp.module
    # The rules parallelize applies to the DDP it builds, read from the flags this one was built with.
    flags = {"find_unused_parameters": ddp.find_unused_parameters, "static_graph": ddp.static_graph}
    _ddp_flags(flags, graph, bool(_reentrant_blocks(model)))
    preflight(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    owners = [param_owner(model, n) for n in names]
    re_idx = _reentrant_params(model, names)
    units = [(_ddp_unit(model, names, owners), False)]
    if not keep_buffer_sync and not sync_buffers_each_forward(model):
        ddp.forward_sync_buffers = False  # after its init sync, as parallelize's DDP (sync_buffers_each_forward)
    return _attach_state(ddp, names, re_idx, units, ddp.process_group, strategy="ddp", graph=graph, compiled=set())


def _placement(strategy: str, device_mesh: Any) -> Parallelism:
    """(strategy, data-parallel ranks, shard size) as the budget counts them: FSDP2 over a 2-D mesh is HSDP."""
    world = dist.get_world_size() if device_mesh is None or device_mesh.ndim == 2 else device_mesh.size()
    if device_mesh is not None and device_mesh.ndim == 2:
        return Parallelism("hsdp", world, device_mesh.size(1))
    return Parallelism(strategy, world)


def _refuse_unready(model: nn.Module, strategy: str) -> None:
    """What parallelize refuses before building anything: no process group, a model already wrapped,
    a budget still waiting for its first forward under FSDP, and what preflight refuses."""
    if not dist.is_initialized():
        raise ConfigError(
            f"strategy={strategy!r} needs torch.distributed initialized: run under torchrun and call "
            "dist.init_process_group first, or use strategy='none'."
        )
    kind = parallel_kind(model)
    if kind:
        raise ConfigError(
            f"distckpt.parallelize got a model already wrapped in {kind}. Pass the plain model (after "
            "distckpt.wrap); parallelize applies the wrapper itself."
        )
    if strategy in SHARDED and pending_plan(model):
        raise ConfigError(
            f"distckpt.wrap(model, budget) has not chosen its blocks yet (it waits for the first forward), but "
            f"{strategy} shards each block now, after which a block's checkpointing cannot change. Pass "
            "example_inputs=(a batch) to distckpt.wrap."
        )
    preflight(model)
    if strategy in SHARDED:
        _refuse_conditional_units(model, strategy)


def _reentrant_params(model: nn.Module, names: list[str]) -> set[int]:
    """Indices (in ``names``) of the trainable parameters inside reentrant-checkpointed blocks."""
    index = {n: i for i, n in enumerate(names)}
    re_blocks = _reentrant_blocks(model)
    return {
        index[f"{bn}.{pn}"]
        for bn, b in model.named_modules()
        if b in re_blocks
        for pn, p in b.named_parameters()
        if p.requires_grad
    }


def _apply_ddp(
    model: nn.Module, graph: str, reentrant: bool, device_mesh: Any, kwargs: dict[str, Any]
) -> tuple[nn.Module, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = _device()
    flags = _ddp_flags(kwargs, graph, reentrant)
    if "broadcast_buffers" not in flags and "forward_sync_buffers" not in flags:
        # DDP's own name since torch 2.13 (broadcast_buffers is deprecated): the buffers are still synced at init.
        flags["forward_sync_buffers"] = sync_buffers_each_forward(model)
    if device_mesh is not None and device_mesh.ndim == 1:
        flags["device_mesh"] = device_mesh
    # A 2-D mesh spans the world (checked): DDP replicates over all of it, its default group.
    group = flags.get("process_group") or mesh_group(device_mesh)
    wrapped = DDP(model, device_ids=[dev] if dev.type == "cuda" else None, **flags)
    return wrapped, group


def sync_buffers_each_forward(model: nn.Module) -> bool:
    """DDP's ``forward_sync_buffers`` (``broadcast_buffers`` before torch 2.13) for ``model`` when the user does not
    choose it: False unless a module keeps running statistics (BatchNorm and the other ``_NormBase`` modules with
    ``track_running_stats``). DDP still syncs the buffers once, when it is built.

    DDP broadcasts every buffer from rank 0 at the start of EVERY forward. A step whose forwards differ in number
    across ranks (a second task's forward on some ranks and steps) pairs that broadcast with another collective on
    the other rank: a hang (measured: HF Llama's rotary ``inv_freq``, a constant buffer in a multi-task model). DDP
    already made the buffers equal when it was built, and a buffer the step does not change (rotary tables, masks,
    constants) needs nothing more; running statistics do, so they keep DDP's default (docs/parallel.md: a model with
    BatchNorm must run as many forwards on every rank)."""
    norm = compat.norm_base_class()
    return any(isinstance(m, norm) and m.track_running_stats for m in model.modules())


def _ddp_unit(model: nn.Module, names: list[str], owners: list[tuple[nn.Module, str]]) -> _Unit:
    """DDP's one unit is the root: every trainable parameter joins in the model's forward."""
    return _Unit(model, [(i, *owners[i]) for i in range(len(names))])


def _refuse_conditional_units(model: nn.Module, strategy: str) -> None:
    """A block that runs on some ranks only cannot be an FSDP unit: the ranks' all-gathers would pair
    different units' parameters, silently (pytorch#158719). Refused here; the end-of-step check in
    distckpt.parallel.param_sync catches what a name cannot tell."""
    for name, m in model.named_modules():
        if is_checkpointed(m):
            why = conditional_reason(model, name)
            if why:
                raise ConfigError(
                    f"{name} is checkpointed, so {strategy} would make it its own unit, but it runs conditionally "
                    f"({why}): ranks that route differently would pair the all-gathers of different units and "
                    "compute wrong values. Checkpoint and shard the layer that contains the router instead, e.g. "
                    "distckpt.wrap(model) with blocks=None, or blocks=<the layer class>."
                )


def _fsdp_group(device_mesh: Any, kwargs: dict[str, Any]) -> Any:
    if kwargs.get("process_group") is not None:
        return kwargs["process_group"]
    return mesh_group(device_mesh)


def _unit_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules FSDP/FSDP2 shard as their own units: every checkpointed block and every other
    candidate block of ``wrap`` (as torchtitan shards every layer), except a candidate that runs
    conditionally (an expert: ranks would pair different units' all-gathers) and is not checkpointed
    (a checkpointed one is refused before). A kept block in the root unit would stay unsharded for
    the whole step and its gradients until the root's reduce-scatter."""
    chosen = {id(m) for n, m in model.named_modules() if is_checkpointed(m)}
    chosen |= {id(m) for n, m in candidate_blocks(model) if conditional_reason(model, n) is None}
    return [(n, m) for n, m in model.named_modules() if n and id(m) in chosen]


def _units_by_block(
    model: nn.Module, names: list[str], owners: list[tuple[nn.Module, str]]
) -> tuple[list[tuple[str, nn.Module]], dict[str, list[int]]]:
    """Split the trainable params into the block units' (the innermost unit holding each) and the root's ('')."""
    blocks = _unit_blocks(model)
    owned: dict[str, list[int]] = {bn: [] for bn, _ in blocks}
    owned[""] = []
    for i, n in enumerate(names):
        home = max((bn for bn, _ in blocks if n.startswith(bn + ".")), key=len, default="")
        owned[home].append(i)
    return blocks, owned


def _apply_fsdp2(
    model: nn.Module, names: list[str], owners: list[tuple[nn.Module, str]], device_mesh: Any, kwargs: dict[str, Any]
) -> tuple[nn.Module, list[tuple[_Unit, bool]], Any]:
    from torch.distributed.fsdp import fully_shard

    blocks, owned = _units_by_block(model, names, owners)
    if "mesh" in kwargs:
        raise ConfigError("pass the mesh as parallelize(..., device_mesh=mesh), not mesh=.")
    # Checkpointing is inside each block's forward; fully_shard each block (checkpointed or not), root last. With a 2-D
    # ("replicate", "shard") mesh fully_shard applies HSDP itself: reduce-scatter within "shard", then
    # all-reduce across "replicate".
    for _, block in blocks:
        fully_shard(block, mesh=device_mesh, **kwargs)
    fully_shard(model, mesh=device_mesh, **kwargs)
    units = [(_Unit(b, [(i, *owners[i]) for i in owned[bn]], bn), True) for bn, b in blocks]
    # prepend=True: the join must run before FSDP2's post-forward hook reshards the parameters.
    units.append((_Unit(model, [(i, *owners[i]) for i in owned[""]]), True))
    # The used bits are all-reduced over every data-parallel rank: the world for HSDP's 2-D mesh.
    return model, units, mesh_group(device_mesh)


def _apply_fsdp(
    model: nn.Module, names: list[str], owners: list[tuple[nn.Module, str]], device_mesh: Any, kwargs: dict[str, Any]
) -> tuple[nn.Module, list[tuple[_Unit, bool]], Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    if kwargs.get("use_orig_params") is False:
        raise ConfigError(
            "use_orig_params=False hides each parameter's gradient inside a flat parameter, so distckpt cannot "
            "leave the gradient of a parameter no rank used as None. Remove use_orig_params (distckpt sets True)."
        )
    if "auto_wrap_policy" in kwargs:
        raise ConfigError(
            "auto_wrap_policy is set by distckpt.parallelize (one FSDP unit per block, so "
            "checkpointing sits inside the units, pytorch#82203). Remove it, or choose blocks in distckpt.wrap."
        )
    blocks, owned = _units_by_block(model, names, owners)
    unit_ids = {id(b) for _, b in blocks}
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in unit_ids)
    extra = {"device_mesh": device_mesh} if device_mesh is not None else {}
    wrapped = FSDP(
        model,
        auto_wrap_policy=policy,
        device_id=kwargs.pop("device_id", _device()),
        use_orig_params=True,
        **extra,
        **kwargs,
    )
    # FSDP1 runs the inner module's hooks while the unit is unsharded: the join goes there.
    units = [(_Unit(b, [(i, *owners[i]) for i in owned[bn]], bn), False) for bn, b in blocks]
    units.append((_Unit(model, [(i, *owners[i]) for i in owned[""]]), False))
    return wrapped, units, _fsdp_group(device_mesh, kwargs)


# --- preflight ----------------------------------------------------------------------------------


def preflight(model: nn.Module) -> None:
    """Audit a model wrapped (by the user or by ``parallelize``) around checkpointed blocks.

    Checks: checkpointing sits inside FSDP units (pytorch#82203), reentrant checkpointing is not
    combined with ``find_unused_parameters`` or without ``static_graph``, no PyTorch
    ``checkpoint_wrapper`` wraps a DDP/FSDP module, and FSDP1 units keep each parameter's gradient.

    Args:
        model: a DDP/FSDP-wrapped or FSDP2-sharded model, or a plain one.

    Raises:
        ConfigError: naming the cause and the fix.
    """
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    parallel_types = (DistributedDataParallel, FullyShardedDataParallel, FSDPModule)
    for name, m in model.named_modules():
        inner = [n for n, c in m.named_modules() if n and isinstance(c, parallel_types)]
        if (is_checkpointed(m) or isinstance(m, compat.checkpoint_wrapper_class())) and inner:
            where = _clean_fqn(name) or type(m).__name__
            raise ConfigError(
                f"{where} is checkpointed around the FSDP/DDP unit {_clean_fqn(inner[0])}: the recompute runs "
                "outside the unit's unshard/reshard (pytorch#82203). Checkpoint the blocks first "
                "(distckpt.wrap), then shard them: distckpt.parallelize does both in that order."
            )
    if getattr(model, _STATE, None) is not None:
        return  # built by parallelize
    reentrant = bool(_reentrant_blocks(model))
    if isinstance(model, DistributedDataParallel):
        if reentrant and model.find_unused_parameters:
            raise ConfigError(
                "reentrant checkpointing with find_unused_parameters=True fails with 'Expected to mark a variable "
                "ready only once' (the nested backward marks parameters DDP already declared unused). Use "
                "distckpt.wrap(..., reentrant=False), or DDP(static_graph=True) for a graph that never changes."
            )
        if reentrant and not model.static_graph:
            raise ConfigError(
                "reentrant checkpointing without static_graph breaks on two forwards before one backward and "
                "silently desyncs LoRA-style models (pytorch#121594). Use distckpt.wrap(..., reentrant=False), "
                "or DDP(static_graph=True) for a graph that never changes."
            )
    if isinstance(model, FullyShardedDataParallel):
        units = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
        for name, m in model.named_modules():
            if is_checkpointed(m) and not any(
                m is u.module or any(m is c for c in u.module.modules()) for u in units if u is not model
            ):
                raise ConfigError(
                    f"checkpointed block {_clean_fqn(name)} is not inside its own FSDP unit, so the whole model is "
                    "unsharded during its recompute. Wrap with auto_wrap_policy that wraps each checkpointed block "
                    "(or use distckpt.parallelize(model, 'fsdp'))."
                )


# --- accumulate ---------------------------------------------------------------------------------


@contextlib.contextmanager
def accumulate(model: nn.Module) -> Iterator[None]:
    """No gradient sync for the micro-batches run inside: DDP/FSDP ``no_sync``, FSDP2
    ``set_requires_gradient_sync(False)``. Run forward and backward inside; run the last
    micro-batch outside, where gradients are reduced once for the whole window.

    Args:
        model: the model ``parallelize`` returned (or a user-built DDP/FSDP/FSDP2 model).
    """
    from torch.distributed.fsdp import FSDPModule

    state: SyncState | None = getattr(model, _STATE, None)
    if getattr(model, "static_graph", False):
        # What parallelize recorded (a user-built DDP with static_graph=True has no state: its graph is static).
        reentrant = state is not None and bool(state.reentrant)
        graph = "static" if state is None or state.static_check else "auto"
        raise ConfigError(accumulate_refusal("ddp", reentrant=reentrant, graph=graph))
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        ctx: Any = contextlib.nullcontext()
    elif hasattr(model, "no_sync"):
        ctx = model.no_sync()
    else:
        ctx = contextlib.nullcontext()
    if state is not None:
        state.sync = False
    try:
        with ctx:
            yield
    finally:
        if state is not None:
            state.sync = True
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(True)
