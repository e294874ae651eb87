"""Every private PyTorch API distckpt uses, each behind one named function with the reason it is
needed and the version it was verified on. tests/unit/test_torch_compat.py calls each once, so a
torch upgrade that moves one fails that test by name instead of dozens of others.

Verified on torch 2.13.0 (CPU, gloo). Nothing here is public API of torch.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = [
    "checkpoint_wrapper_class",
    "compile_counts",
    "composable_checkpoint_fqns",
    "cpu_flash_attention_ops",
    "current_graph_task_id",
    "default_store",
    "dynamo_trace_errors",
    "forward_side_effects_once",
    "fake_mode",
    "fsdp2_reduces_grads",
    "is_plain_backward",
    "mem_tracker",
    "mem_tracker_merge_peak",
    "mem_tracker_peak_snapshot",
    "mem_tracker_restart_peak",
    "mem_tracker_states",
    "norm_base_class",
    "op_overload_types",
    "outside_fake_mode",
    "queue_after_backward",
    "running_pipeline",
    "sac_planner",
    "sac_runtimes_as_flops",
    "saved_tensors_of",
    "splits_backward",
    "sdpa_flop_count_fns",
    "stop_recomputation_error",
    "storage_id",
    "to_local",
    "torch_dispatch_mode",
    "tree_flatten",
    "tree_map",
    "tree_unflatten",
    "version",
    "will_execute",
    "writes_grad",
]


def will_execute(node: Any) -> bool:
    """Whether the running autograd pass will execute ``node`` (``torch._C._will_engine_execute_node``).

    Why: the only way to tell, before any gradient is accumulated, which parameters a backward
    reaches (used) and which it does not (unused: they get a zero gradient). Raises RuntimeError on a
    leaf's AccumulateGrad node under ``torch.autograd.grad`` (see :func:`writes_grad`). torch 2.13.
    """
    return torch._C._will_engine_execute_node(node)


def current_graph_task_id() -> int:
    """An id of the running autograd pass (``torch._C._current_graph_task_id``), to do per-pass
    bookkeeping once per pass. torch 2.13."""
    return torch._C._current_graph_task_id()


def is_plain_backward() -> bool:
    """Whether the running pass is ``backward()`` without ``inputs=`` (every reachable node runs).

    ``torch.autograd._is_checkpoint_valid`` is what reentrant checkpoint itself uses to refuse
    ``autograd.grad``; it is False for ``autograd.grad`` and ``backward(inputs=...)``. torch 2.13.
    """
    return torch.autograd._is_checkpoint_valid()


def inside_ddp_forward() -> bool:
    """Whether a ``DistributedDataParallel`` forward is running (it sets this class attribute for its duration;
    torch's own compiled-DDP support reads it). There is no public way to ask. torch 2.13."""
    from torch.nn.parallel import DistributedDataParallel

    return getattr(DistributedDataParallel, "_active_ddp_module", None) is not None


def writes_grad(keys: Iterable[tuple[Any, int]]) -> bool:
    """In a pass that is not a plain backward: whether it accumulates into some ``.grad`` of these
    gradient edges (``backward(inputs=...)``) rather than returning gradients (``autograd.grad``).

    ``_will_engine_execute_node`` refuses leaf nodes under ``autograd.grad`` with a RuntimeError
    ("currently not supported"): that refusal is the signal. torch 2.13.
    """
    try:
        return any(torch._C._will_engine_execute_node(node) for node, _ in keys)
    except RuntimeError:
        return False


def queue_after_backward(fn: Callable[[], None]) -> None:
    """Run ``fn`` at the end of the running backward, after callbacks already queued by then *and*
    after those they queue (DDP's finalize is queued by its last bucket, during the pass).

    ``Variable._execution_engine.queue_callback`` is private; queuing from inside a queued callback
    puts ``fn`` behind DDP's own. torch 2.13.
    """
    engine = torch.autograd.Variable._execution_engine
    engine.queue_callback(lambda: engine.queue_callback(fn))


def fsdp2_reduces_grads(modules: Iterable[torch.nn.Module]) -> bool:
    """Whether FSDP2 will reduce the gradients of the next backward through ``modules`` (``fully_shard`` units):
    False after ``set_requires_gradient_sync(False)``, which ``torch.distributed.pipelining`` sets for every
    micro-batch's backward before reducing all of them at once, outside autograd (``perform_reduce_grad``).

    FSDP2 has a setter and no getter; the flag is each ``FSDPParamGroup``'s ``reduce_grads`` (private,
    ``torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py``). torch 2.13.
    """
    from torch.distributed.fsdp import FSDPModule

    for m in modules:
        if isinstance(m, FSDPModule):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                if not group.reduce_grads:
                    return False
    return True


_SCHEDULES, _STAGES = "torch.distributed.pipelining.schedules", "torch.distributed.pipelining.stage"


def running_pipeline() -> tuple[Any, Any] | None:
    """The ``torch.distributed.pipelining`` schedule whose ``step()`` is running on this thread and the innermost of
    its stages on the call stack (None if no stage's method is), or None outside a schedule's step.

    Why: a schedule hands the modules it runs no reference to itself (nor does a stage); it calls them from its
    own methods, whose frames hold it as ``self`` (``schedules.py``; a stage's in ``stage.py``). Read from the
    frames of those two modules only. torch 2.13.
    """
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle

    stage = None
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__")
        if module in (_SCHEDULES, _STAGES):
            owner = frame.f_locals.get("self")
            if module == _STAGES and stage is None and hasattr(owner, "submod"):
                stage = owner
            elif isinstance(owner, (PipelineScheduleMulti, PipelineScheduleSingle)):
                return owner, stage
        frame = frame.f_back
    return None


def splits_backward(schedule: Any) -> bool:
    """Whether ``schedule`` splits a micro-batch's backward into an input-gradient pass and a later weight-gradient
    pass (``W`` actions: ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``, a
    schedule loaded from a CSV with ``W``), which computes the weight gradients with respect to
    ``stage.submod.parameters()`` (``stage_backward_weight``).

    Why: the actions (``pipeline_order``, ``pipeline_order_with_comms``) are private ``_Action`` tuples of a private
    ``_ComputationType``; no public attribute says which passes a schedule runs. torch 2.13.
    """
    from torch.distributed.pipelining.schedules import _ComputationType

    weight = _ComputationType.BACKWARD_WEIGHT

    def actions(acts: Iterable[Any]) -> Iterator[Any]:
        for a in acts:
            if a is not None:
                yield a
                yield from actions(a.sub_actions or ())  # OVERLAP_F_B (DualPipeV) holds its passes inside

    orders = [getattr(schedule, "pipeline_order", None), getattr(schedule, "pipeline_order_with_comms", None)]
    return any(
        a.computation_type == weight for order in orders if order for acts in order.values() for a in actions(acts)
    )


def to_local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2 grads), or ``t`` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def checkpoint_wrapper_class() -> tuple[type, ...]:
    """PyTorch's ``CheckpointWrapper`` (from ``torch.distributed.algorithms._checkpoint``), to refuse
    a model that already uses ``apply_activation_checkpointing``; ``()`` where it is missing. torch 2.13."""
    try:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    except ImportError:  # pragma: no cover - torch built without distributed
        return ()
    return (CheckpointWrapper,)


def composable_checkpoint_fqns(model: torch.nn.Module) -> list[str]:
    """FQNs of modules under ``torch.distributed._composable.checkpoint`` (read from the composable
    API registry, ``_composable.contract._get_registry``), so a block is not recomputed twice. torch 2.13."""
    try:
        from torch.distributed._composable.contract import _get_registry
    except ImportError:  # pragma: no cover
        return []
    return [n for n, m in model.named_modules() if "checkpoint" in (_get_registry(m) or {})]


def torch_dispatch_mode() -> type:
    """``TorchDispatchMode`` (``torch.utils._python_dispatch``): verify_recompute records every aten op
    of a block's forward and of its recompute to compare them op by op; no public API sees ops inside
    a checkpointed region. torch 2.13."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def weak_id_dict() -> Any:
    """A dictionary keyed by tensor identity that does not keep its keys alive
    (``torch.utils.weak.WeakIdKeyDictionary``: tensors are not hashable by value, and ``id()`` is reused once a
    tensor dies): verify_recompute's recorder remembers which module each op output came from, to name a
    router. torch 2.13."""
    from torch.utils.weak import WeakIdKeyDictionary

    return WeakIdKeyDictionary()


class _NoHook:
    """Stands in for the gradient-hook handles MemTracker keeps per parameter."""

    def remove(self) -> None:
        pass


def mem_tracker(frozen: Iterable[torch.Tensor]) -> Any:
    """A ``MemTracker`` (``torch.distributed._tools.mem_tracker``: the only tracker that splits a
    step's memory into params, grads, activations and temporaries on CPU) that skips the gradient
    hooks of ``frozen`` parameters and of non-leaf ones: MemTracker's ``register_hook`` raises on a
    tensor that does not require grad (LoRA), and ``register_post_accumulate_grad_hook`` on a non-leaf
    one (FSDP1 with ``use_orig_params=True`` shows each parameter as a view of its flat parameter in
    forward; the flat parameter's own gradient is still tracked). A present entry in its private
    ``_param_to_grad_hook_handles`` map skips the registration; a subclass adds the non-leaf ones
    as its private ``_track_module_params_and_buffers`` meets them. torch 2.13."""
    tracker = _leaf_only_tracker_class()()
    for p in frozen:
        tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
    return tracker


_TRACKER_CLASS: list[type] = []


def _leaf_only_tracker_class() -> type:
    if not _TRACKER_CLASS:
        from torch.distributed._tools.mem_tracker import MemTracker

        class _LeafOnlyMemTracker(MemTracker):
            def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> Any:
                for p in module.parameters():
                    if not p.is_leaf and self._param_to_grad_hook_handles.get(p) is None:
                        self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
                return super()._track_module_params_and_buffers(module, install_grad_hooks)

            def _update_peak_stats(self, peak_state: Any) -> None:
                _fast_update_peak_stats(self, peak_state)

        _TRACKER_CLASS.append(_LeafOnlyMemTracker)
    return _TRACKER_CLASS[0]


def _fast_update_peak_stats(tracker: Any, peak_state: Any) -> None:
    """MemTracker's private ``_update_peak_stats`` (run after every op) with the same effect, faster: it
    reads the stats of every module tracked so far through ``WeakIdKeyDictionary.values()``, whose
    weak-reference call (a ``hasattr`` for tensor resurrection) and the ``deepcopy`` of each flat
    ``{kind: bytes}`` snapshot were a fifth of a fake-tensor sample step (cProfile, a 4-block GPT, torch
    2.13). Here the dictionary's private ``data`` is read directly (the stats of a module already
    collected are updated too: no one can read them) and snapshots are copied with ``dict``. torch 2.13;
    tests/unit/test_torch_compat.py compares every snapshot with the stock tracker's."""
    tracked = getattr(tracker.memory_tracking, "data", None)
    if not isinstance(tracked, dict):  # another torch: its own (slower) update
        from torch.distributed._tools.mem_tracker import MemTracker

        MemTracker._update_peak_stats(tracker, peak_state)
        return
    curr_snap = tracker._curr_mem_snap
    parents = tracker._mod_tracker.parents
    # A list first: a weak reference's callback (a collected module) may remove an entry meanwhile.
    for mod_stats in list(tracked.values()):
        if mod_stats.mod_fqn in parents and peak_state in mod_stats.snapshots:
            local = mod_stats.local_peak
            for dev, dev_snap in curr_snap.items():
                if local.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                    local[dev] = dev_snap[_TOTAL_KEY]
                    mod_stats.snapshots[peak_state][-1][dev] = dict(dev_snap)
    for dev, dev_snap in curr_snap.items():
        if tracker._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
            tracker._peak_mem[dev] = dev_snap[_TOTAL_KEY]
            tracker._peak_mem_snap[dev] = dict(dev_snap)


_TOTAL_KEY = "Total"  # torch.distributed._tools.mem_tracker._TOTAL_KEY


def mem_tracker_states(post: bool = False) -> tuple[Any, Any]:
    """MemTracker's keys of per-module snapshots (the private ``_ModState`` enum): (peak in forward,
    peak in backward), or with ``post`` (after backward, before backward). torch 2.13."""
    from torch.distributed._tools.mem_tracker import _ModState

    return (_ModState.POST_BW, _ModState.PRE_BW) if post else (_ModState.PEAK_FW, _ModState.PEAK_BW)


def op_overload_types() -> tuple[type, type]:
    """``torch._ops.OpOverload`` and ``OpOverloadPacket``: the types of ``torch.ops.aten.mm.default``
    and ``torch.ops.aten.mm``, to accept either in a selective-checkpointing op list. torch 2.13."""
    return torch._ops.OpOverload, torch._ops.OpOverloadPacket


def mem_tracker_restart_peak(tracker: Any) -> Any:
    """Restart MemTracker's running peak and return what it held (for :func:`mem_tracker_merge_peak`),
    or ``None`` when the private ``_peak_mem``/``_peak_mem_snap`` fields are absent: the profiler then
    skips the head's own window (the head is bounded from the whole step). MemTracker has no public
    way to read a peak over a sub-window of a step. torch 2.13."""
    if not hasattr(tracker, "_peak_mem") or not hasattr(tracker, "_peak_mem_snap"):
        return None
    saved = (tracker._peak_mem, tracker._peak_mem_snap)
    tracker._peak_mem, tracker._peak_mem_snap = {}, {}
    return saved


def mem_tracker_peak_snapshot(tracker: Any) -> dict[Any, dict[str, int]]:
    """The snapshot (per device, per memory kind) at the running peak since the last restart. torch 2.13."""
    return tracker._peak_mem_snap


def mem_tracker_merge_peak(tracker: Any, saved: Any) -> None:
    """Fold a peak saved by :func:`mem_tracker_restart_peak` back in, so the tracker's overall peak is
    the maximum over both windows, as if it had never been restarted. torch 2.13."""
    old_peak, old_snap = saved
    for d, v in old_peak.items():
        if v >= tracker._peak_mem.get(d, -1):
            tracker._peak_mem[d], tracker._peak_mem_snap[d] = v, old_snap[d]


def fake_mode() -> Any:
    """A ``FakeTensorMode`` (``torch._subclasses.fake_tensor``): ``distckpt plan`` builds a model and runs
    one sample step of it with tensors that have shapes, dtypes and storages but no data, so a 70B model
    is planned on a laptop; MemTracker and FlopCounterMode work under it. No public API does this
    (the meta device has no autograd-tracked storages MemTracker can follow). torch 2.13."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def outside_fake_mode() -> Any:
    """A context in which tensors are real again while a :func:`fake_mode` is active (the private
    ``unset_fake_temporarily``): ``distckpt plan`` draws the factory's sample batch there, since a data
    loader reads values (a seeded shuffle) that fake tensors do not have. torch 2.13."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def storage_id(t: torch.Tensor) -> int:
    """An identity of ``t``'s storage that also tells fake storages apart: the address of its
    ``StorageImpl`` (the private ``_cdata``); ``data_ptr()`` is 0 for every fake tensor. torch 2.13."""
    return t.untyped_storage()._cdata


def version(t: torch.Tensor) -> int:
    """``t``'s version counter (the private ``_version``, shared by the views of one storage and bumped by
    each in-place write): tells an offloaded forward that a tensor it saved before was written since, so
    a second save of it is not the first's copy. torch 2.13."""
    return t._version


def sdpa_flop_count_fns() -> tuple[Callable[..., int], Callable[..., int]]:
    """torch's own FLOP arithmetic for attention, ``sdpa_flop_count(q, k, v)`` and
    ``sdpa_backward_flop_count(grad_out, q, k, v)`` (shapes ``[batch, heads, seq, dim]``; GQA: fewer
    key/value heads), from ``torch.utils.flop_counter`` outside its ``__all__``. They are what
    ``FlopCounterMode`` uses for the CUDA attention kernels; reusing them keeps CPU counts equal to
    CUDA ones. torch 2.13."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    return sdpa_flop_count, sdpa_backward_flop_count


def cpu_flash_attention_ops() -> tuple[Any, Any] | None:
    """The CPU attention kernel and its backward as op packets,
    ``aten._scaled_dot_product_flash_attention_for_cpu`` and ``..._backward`` (private aten ops: what
    ``F.scaled_dot_product_attention`` dispatches to on CPU), or ``None`` on a build without them.
    ``FlopCounterMode`` has no formula for them in torch 2.13. Schemas (torch 2.13):
    ``(query, key, value, dropout_p, is_causal, *, attn_mask, scale)`` and
    ``(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask, scale)``."""
    aten = torch.ops.aten
    try:
        return (
            aten._scaled_dot_product_flash_attention_for_cpu,
            aten._scaled_dot_product_flash_attention_for_cpu_backward,
        )
    except AttributeError:  # pragma: no cover - a build without the CPU flash kernel
        return None


def saved_tensors_of(node: Any) -> list[torch.Tensor]:
    """The tensors an autograd node saved for its backward, read through the generated private
    ``_saved_<name>`` attributes (tensors, or tuples of them; ``None`` for an undefined one).

    Why: a Python number passed where an op takes a tensor (``0.5 * x``) becomes a 0-dim CPU
    tensor (a "wrapped number") made by the argument parser, outside any dispatch mode, and autograd
    saves it without calling saved-tensor hooks (``SavedVariable``: "avoid wrapped numbers from being
    leaked to the user"), so neither the profile's hooks nor MemTracker see it; only the node holds
    it. Reading an attribute unpacks it (the hooks' unpack, if any). torch 2.13."""
    out: list[torch.Tensor] = []
    for name in dir(node):
        if not name.startswith("_saved_"):
            continue
        try:
            value = getattr(node, name)
        except RuntimeError:  # freed already (after its backward), or not readable
            continue
        values = value if isinstance(value, (tuple, list)) else (value,)
        out.extend(v for v in values if isinstance(v, torch.Tensor))
    return out


def stop_recomputation_error() -> type:
    """The exception non-reentrant checkpoint raises to stop a recompute early
    (``torch.utils.checkpoint._StopRecomputationError``): a recompute context exits with it when
    backward has every saved tensor, and the op-level policies learn how far it got
    (:class:`distckpt.runtime.selective._Reach`). No public name for it. torch 2.13."""
    from torch.utils.checkpoint import _StopRecomputationError

    return _StopRecomputationError


def dynamo_trace_errors() -> tuple[type, ...]:
    """What ``torch.compile(fullgraph=True)`` raises when it cannot trace a function in one graph: a graph break
    (``torch._dynamo.exc.Unsupported``), data-dependent control flow (``GuardOnDataDependentSymNode``, e.g. an expert
    that runs only when a token chose it; ``UserError`` when that happens inside the checkpoint's higher-order op),
    or a checkpoint body dynamo could not capture (``UncapturedHigherOrderOpError``). Per-block compile turns them
    into a ConfigError naming the block and the fix. Measured, torch 2.13; no public names for them."""
    from torch._dynamo.exc import UncapturedHigherOrderOpError, Unsupported, UserError
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return Unsupported, UserError, UncapturedHigherOrderOpError, GuardOnDataDependentSymNode


def forward_side_effects_once() -> contextlib.AbstractContextManager[Any]:
    """Dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint``: a Python side effect in a checkpointed forward
    that dynamo traces with its checkpoint (distckpt's per-block compile) runs once per forward, as without
    checkpointing, instead of being refused inside the checkpoint's higher-order op ("HOP: Unsafe side effect",
    "Non-nullified side effect"). Needed since transformers 5.25: every attention forward sets and resets the
    ``kernels`` package's context variable (``use_kernelized_func``). A ``torch._dynamo.config`` flag, read while
    dynamo traces; no public switch. torch 2.13."""
    import torch._dynamo

    return torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)


@contextlib.contextmanager
def compile_counts() -> Iterator[dict[str, Any]]:
    """Count what dynamo does inside the block: ``{"graphs": unique graphs compiled, "breaks": {reason: count}}``,
    filled at exit, from the private ``torch._dynamo.utils.counters`` (``stats.unique_graphs``, ``graph_break``):
    the tests prove a compiled model has no graph break but the deliberate ones. torch 2.13."""
    from torch._dynamo.utils import counters

    graphs, breaks = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
    out: dict[str, Any] = {}
    try:
        yield out
    finally:
        out["graphs"] = counters["stats"]["unique_graphs"] - graphs
        out["breaks"] = {k: v - breaks.get(k, 0) for k, v in counters["graph_break"].items() if v > breaks.get(k, 0)}


# torch.utils._pytree: the nested-structure walk torch itself uses (lists, tuples, dicts, namedtuples, and the
# containers torch and libraries register, such as Hugging Face's ModelOutput). torch 2.13 has no public
# pytree module; the profile finds a step's tensors with it, the plan makes fake inputs, and the
# parameter-sync join rebuilds a unit's output around its zero-weight term.


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """The leaves of ``tree`` in torch's order and its structure (``torch.utils._pytree.tree_flatten``). torch 2.13."""
    from torch.utils import _pytree

    return _pytree.tree_flatten(tree)


def tree_unflatten(leaves: list[Any], spec: Any) -> Any:
    """The structure ``spec`` (from :func:`tree_flatten`) rebuilt around ``leaves``
    (``torch.utils._pytree.tree_unflatten``). torch 2.13."""
    from torch.utils import _pytree

    return _pytree.tree_unflatten(leaves, spec)


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` with ``fn`` applied to each leaf (``torch.utils._pytree.tree_map``). torch 2.13."""
    from torch.utils import _pytree

    return _pytree.tree_map(fn, tree)


def norm_base_class() -> type:
    """``torch.nn.modules.batchnorm._NormBase``: the base of every BatchNorm and InstanceNorm (lazy and
    sync ones included), the modules with running statistics (``track_running_stats``) that a recompute
    would update a second time (pytorch#96136). No public base class covers them all. torch 2.13."""
    return torch.nn.modules.batchnorm._NormBase


def default_store() -> Any:
    """The default process group's c10d store (``distributed_c10d._get_default_store``): the hang watchdog's
    thread publishes a rank's status there when a wait stalls, where every other rank's watchdog can read it while
    the main threads are blocked in collectives (a collective could not be used). No public accessor. torch 2.13."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


# torch.distributed._tools: torch's own planner of selective activation checkpointing (SAC), the MILP over modules
# (``sac_ilp.sac_milp``: which modules to checkpoint and what share of their activations to discard) and per module
# over ops (``get_optimal_checkpointing_policy_per_module``), on statistics of a step run under FakeTensorMode
# (``SACEstimator``, ``MemTracker``, ``RuntimeEstimator``, gathered by ``ilp_utils.aggregate_stats``). Private and
# undocumented; benchmarks.frontier compares the budget with it at the same measured peak. Its MILP needs ``pulp``
# and its trade-off curves ``pwlf`` (the ``bench`` extra). torch 2.13.


def sac_planner() -> Any:
    """torch's SAC planner as one namespace: ``SACEstimator``, ``MemTracker``, ``RuntimeEstimator``,
    ``aggregate_stats``, ``parse_module_info``, ``sac_milp``, ``get_optimal_checkpointing_policy_per_module`` and
    ``OPS_TO_ALWAYS_SKIP`` (the ops its per-op decisions skip, as a policy must). torch 2.13.

    Raises:
        ImportError: ``pulp`` or ``pwlf`` is not installed (``pip install -e ".[bench]"``).
    """
    import types

    import pwlf  # noqa: F401  - the trade-off curves need it; fail here, not deep inside aggregate_stats
    from torch.distributed._tools import ilp_utils, mem_tracker, runtime_estimator, sac_estimator, sac_ilp

    return types.SimpleNamespace(
        SACEstimator=sac_estimator.SACEstimator,
        MemTracker=mem_tracker.MemTracker,
        RuntimeEstimator=runtime_estimator.RuntimeEstimator,
        aggregate_stats=ilp_utils.aggregate_stats,
        parse_module_info=ilp_utils.parse_module_info,
        sac_milp=sac_ilp.sac_milp,
        get_optimal_checkpointing_policy_per_module=sac_ilp.get_optimal_checkpointing_policy_per_module,
        OPS_TO_ALWAYS_SKIP=sac_estimator.OPS_TO_ALWAYS_SKIP,
    )


@contextlib.contextmanager
def sac_runtimes_as_flops(count: Callable[[Any, Any, Any], tuple[Any, int]]) -> Iterator[None]:
    """Inside: torch's ``RuntimeEstimator`` runs every op through ``count(func, args, kwargs)``, which returns
    its output and FLOPs, and prices it at those FLOPs (as milliseconds at 1 TFLOP/s) in its
    ``"operator-level-cost-model"`` mode, for the ``SACEstimator`` made inside too. Why: its two modes time ops
    on CUDA only (the roofline reads the GPU's peak FLOP/s, the benchmark mode uses CUDA events); on the CPU,
    FLOPs are also the cost the budget minimises, so both planners minimise the same thing.
    ``RuntimeEstimator._roofline_estimate`` is a classmethod that ``SACEstimator`` reads when it is made or
    called. torch 2.13."""
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator

    original = RuntimeEstimator.__dict__["_roofline_estimate"]

    def estimate(cls: Any, func: Any, args: Any, kwargs: Any) -> tuple[Any, float]:
        out, flops = count(func, args, kwargs or {})
        return out, flops / 1e9

    RuntimeEstimator._roofline_estimate = classmethod(estimate)
    try:
        yield
    finally:
        RuntimeEstimator._roofline_estimate = original
