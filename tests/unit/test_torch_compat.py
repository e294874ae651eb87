"""Each private torch API behind distckpt._torch_compat, called once: a torch upgrade that moves one
fails here, by name, before it fails dozens of other tests. And no module of distckpt/ but that one
reaches a private torch name (``torch.*._name``) itself: :func:`private_torch_uses` scans them."""

from __future__ import annotations

import ast
import contextlib
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.autograd.graph import get_gradient_edge

from distckpt import _torch_compat as compat

LIBRARY = Path(__file__).resolve().parents[2] / "distckpt"


def _private(parts: list[str]) -> bool:
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts)


def _dotted(node: ast.AST) -> list[str] | None:
    """``["a", "b", "c"]`` for the expression ``a.b.c``; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def private_torch_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted name) of every private torch name in ``tree``: an import of one (``import torch._dynamo``,
    ``from torch.utils._pytree import tree_map``, ``from torch import _C``), or an attribute reached from a name
    bound to torch or to a part of it (``torch._C._x``, ``nn.modules.batchnorm._NormBase`` after ``import
    torch.nn as nn``, ``aten._op`` after ``aten = torch.ops.aten``, ``getattr(torch, "_x")``). Attributes of
    objects (``module._buffers``, ``t._version``) have no static type here and are not seen."""
    bound: dict[str, list[str]] = {}  # local name -> the torch path it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    found += [(node.lineno, alias.name)] if _private(alias.name.split(".")) else []
                    bound[alias.asname or "torch"] = alias.name.split(".") if alias.asname else ["torch"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                path = [*node.module.split("."), alias.name]
                found += [(node.lineno, ".".join(path))] if _private(path) else []
                bound[alias.asname or alias.name] = path
    for node in ast.walk(tree):  # a name assigned from a torch path stands for it too (aten = torch.ops.aten)
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            parts = _dotted(node.value)
            if parts and parts[0] in bound:
                bound.setdefault(node.targets[0].id, [*bound[parts[0]], *parts[1:]])
    for node in ast.walk(tree):
        parts = _dotted(node) if isinstance(node, ast.Attribute) else None
        if isinstance(node, ast.Call) and _dotted(node.func) == ["getattr"] and len(node.args) >= 2:
            name = node.args[1]
            parts = (_dotted(node.args[0]) or []) + [name.value] if isinstance(name, ast.Constant) else None
        if parts and parts[0] in bound and _private(parts[1:]):
            found.append((node.lineno, ".".join([*bound[parts[0]], *parts[1:]])))
    return sorted(set(found))


def _in_backward(fn, *, inputs=None, grad=False):
    """Run ``fn()`` inside a backward pass (plain, ``inputs=``, or ``autograd.grad``); return its value."""
    seen = {}
    p = torch.randn(3, requires_grad=True)

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen["value"] = fn(p, ctx)
            return g

    y = Probe.apply(p * 2).sum()
    if grad:
        torch.autograd.grad(y, p)
    else:
        y.backward(inputs=inputs)
    return seen["value"]


def test_will_execute_and_graph_task_id():
    assert _in_backward(lambda p, ctx: compat.will_execute(ctx)) is True
    ids = {_in_backward(lambda p, ctx: compat.current_graph_task_id()) for _ in range(2)}
    assert len(ids) == 2  # a new id per pass


def test_plain_backward_and_writes_grad():
    assert _in_backward(lambda p, ctx: compat.is_plain_backward()) is True
    assert _in_backward(lambda p, ctx: compat.is_plain_backward(), grad=True) is False
    edge = lambda p: [(get_gradient_edge(p).node, 0)]  # noqa: E731
    assert _in_backward(lambda p, ctx: compat.writes_grad(edge(p)), grad=True) is False  # autograd.grad
    assert _in_backward(lambda p, ctx: compat.writes_grad(edge(p)), inputs=None) is True


def test_queue_after_backward_runs_after_the_pass():
    order = []
    p = torch.randn(2, requires_grad=True)
    p.register_post_accumulate_grad_hook(lambda _: order.append("accumulated"))

    class Queue(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            compat.queue_after_backward(lambda: order.append("end"))
            return g

    Queue.apply(p * 1).sum().backward()
    assert order == ["accumulated", "end"]


def test_to_local_and_foreign_checkpointing_lookups():
    t = torch.ones(2)
    assert compat.to_local(t) is t
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    (cls,) = compat.checkpoint_wrapper_class()
    assert isinstance(checkpoint_wrapper(nn.Linear(2, 2)), cls)
    from torch.distributed._composable import checkpoint

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    checkpoint(model[1])
    assert compat.composable_checkpoint_fqns(model) == ["1"]


def test_torch_dispatch_mode_sees_ops():
    seen = []

    class Log(compat.torch_dispatch_mode()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Log():
        torch.ones(2) + 1
    assert any("add" in s for s in seen)


def test_mem_tracker_skips_frozen_params_and_its_states():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    model[0].requires_grad_(False)  # LoRA-like: MemTracker's own hook registration raises on these
    tracker = compat.mem_tracker([p for p in model.parameters() if not p.requires_grad])
    tracker.track_external(model)
    with tracker:
        model(torch.randn(2, 4)).sum().backward()
    assert tracker.get_tracker_snapshot("peak")
    fw, bw = compat.mem_tracker_states()
    post, pre = compat.mem_tracker_states(post=True)
    assert len({fw, bw, post, pre}) == 4


class _ViewParams(nn.Module):
    """FSDP1-like (use_orig_params=True): in forward the inner module's weight is a view of a flat parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.flat = nn.Parameter(torch.randn(8))
        self.inner = nn.Linear(4, 2, bias=False)
        del self.inner.weight

    def forward(self, x):
        self.inner._parameters["weight"] = self.flat.view(2, 4)  # non-leaf, as FSDP1 registers it
        return self.inner(x)


def test_mem_tracker_skips_non_leaf_params_and_tracks_the_flat_gradient():
    from torch.distributed._tools.mem_tracker import MemTracker

    model = _ViewParams()
    plain = MemTracker()
    plain.track_external(model)
    with pytest.raises(RuntimeError, match="non-leaf"), plain:
        model(torch.randn(3, 4)).sum().backward()
    model.flat.grad = None
    tracker = compat.mem_tracker([])
    tracker.track_external(model)
    with tracker:
        model(torch.randn(3, 4)).sum().backward()
    assert tracker.get_tracker_snapshot()[torch.device("cpu")]["Gradient"] == 8 * 4  # the flat one


def _tracked_step(tracker, model, x):
    tracker.track_external(model)
    with tracker:
        model(x).sum().backward()
    for p in model.parameters():
        p.grad = None
    stats = {
        name: {state: [dict(s) for s in snaps] for state, snaps in tracker.memory_tracking[m].snapshots.items()}
        for name, m in model.named_modules()
    }
    return stats, tracker.get_tracker_snapshot("peak")


@pytest.mark.parametrize("fake", [False, True])
def test_mem_tracker_peaks_equal_the_stock_trackers(fake):
    # compat.mem_tracker replaces MemTracker's per-op _update_peak_stats with a faster one of the same effect:
    # every module's snapshots (forward/backward peaks, pre/post) and the global peak are the stock tracker's.
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 32), nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.LayerNorm(32)), nn.Linear(32, 4)
    )
    x = torch.randn(16, 8)
    with compat.fake_mode() if fake else contextlib.nullcontext():
        stock = _tracked_step(MemTracker(), model, x)
        ours = _tracked_step(compat.mem_tracker([]), model, x)
    # The fast path's private field (without it the stock update runs: the same snapshots, slower).
    assert isinstance(compat.mem_tracker([]).memory_tracking.data, dict)
    assert ours == stock and any(snaps for per in stock[0].values() for snaps in per.values())


def test_op_overload_types():
    overload, packet = compat.op_overload_types()
    assert isinstance(torch.ops.aten.mm.default, overload) and isinstance(torch.ops.aten.mm, packet)


def test_mem_tracker_peak_window_restart_and_merge():
    model = nn.Linear(64, 64)
    tracker = compat.mem_tracker([])
    tracker.track_external(model)
    with tracker:
        big = torch.randn(512, 512)  # a peak in the first window
        del big
        saved = compat.mem_tracker_restart_peak(tracker)
        assert saved is not None and compat.mem_tracker_peak_snapshot(tracker) == {}
        model(torch.randn(2, 64)).sum().backward()  # a smaller second window
        window = compat.mem_tracker_peak_snapshot(tracker)
        assert window and max(s.get("Total", 0) for s in window.values()) < 512 * 512 * 4
        compat.mem_tracker_merge_peak(tracker, saved)
    overall = tracker.get_tracker_snapshot("peak")
    assert max(s.get("Total", 0) for s in overall.values()) >= 512 * 512 * 4


def test_fake_mode_and_storage_id():
    with compat.fake_mode():
        a = torch.empty(4, 4)
        b, c = a[1:], torch.empty(4, 4)
    assert type(a).__name__ == "FakeTensor"
    assert compat.storage_id(a) == compat.storage_id(b) != compat.storage_id(c)
    x = torch.zeros(3)
    assert compat.storage_id(x) == compat.storage_id(x.view(3, 1)) != compat.storage_id(torch.zeros(3))


def test_sac_planner_prices_ops_at_the_flops_given():
    pytest.importorskip("pulp")
    pytest.importorskip("pwlf")
    tools = compat.sac_planner()
    assert all(callable(f) for f in (tools.sac_milp, tools.get_optimal_checkpointing_policy_per_module))
    assert torch.ops.aten.detach.default in tools.OPS_TO_ALWAYS_SKIP

    def count(func, args, kwargs):
        return func(*args, **kwargs), 2000 if func.overloadpacket is torch.ops.aten.mm else 0

    with compat.sac_runtimes_as_flops(count), compat.fake_mode():
        a, b = torch.randn(4, 4), torch.randn(4, 4)
        est = tools.RuntimeEstimator()
        with est("operator-level-cost-model"):
            torch.mm(a, b).relu()
    assert est.total_runtime == pytest.approx(2000 / 1e9)  # the mm at its 2000 "FLOPs", the relu at 0
    if not torch.cuda.is_available():  # restored: torch's roofline again, which needs CUDA
        with compat.fake_mode(), pytest.raises(AssertionError, match="CUDA"):
            tools.RuntimeEstimator._roofline_estimate(torch.ops.aten.mm.default, (torch.randn(2, 2),) * 2, {})


def test_outside_fake_mode_makes_real_tensors():
    with compat.fake_mode():
        assert type(torch.ones(1)).__name__ == "FakeTensor"
        with compat.outside_fake_mode():
            real = torch.randperm(4, generator=torch.Generator().manual_seed(0))
            assert type(real) is torch.Tensor and sorted(real.tolist()) == [0, 1, 2, 3]


def test_sdpa_flop_count_fns_and_cpu_flash_attention_ops():
    forward, backward = compat.sdpa_flop_count_fns()
    q, kv = (2, 4, 8, 16), (2, 2, 8, 16)  # GQA: 2 key/value heads for 4 query heads
    assert forward(q, kv, kv) == 2 * (2 * 2 * 4 * 8 * 8 * 16)  # q @ k^T and p @ v, per query head
    assert backward(q, q, kv, kv) == 5 * (2 * 2 * 4 * 8 * 8 * 16)  # scores recomputed, then 4 matmuls
    fwd, bwd = compat.cpu_flash_attention_ops()
    x = torch.randn(1, 2, 4, 8, requires_grad=True)
    seen = []

    class Ops(compat.torch_dispatch_mode()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket)
            return func(*args, **(kwargs or {}))

    with Ops():
        torch.nn.functional.scaled_dot_product_attention(x, x, x).sum().backward()
    assert fwd in seen and bwd in seen  # what sdpa dispatches to on CPU


def test_saved_tensors_of_sees_the_wrapped_numbers_hooks_skip():
    packed = []
    x = torch.randn(4, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = 0.5 * x.pow(3)  # PowBackward0 saves x (through the hooks), MulBackward0 the number 0.5 (not)
    assert len(packed) == 1 and packed[0] is x
    scalars = compat.saved_tensors_of(y.grad_fn)
    assert [(t.dim(), t.dtype, t.item()) for t in scalars] == [(0, torch.float64, 0.5)]
    pow_node = y.grad_fn.next_functions[0][0]
    assert [t.data_ptr() for t in compat.saved_tensors_of(pow_node)] == [x.data_ptr()]
    y.sum().backward()
    assert compat.saved_tensors_of(y.grad_fn) == []  # freed by the backward: nothing to read


def test_stop_recomputation_error_is_what_checkpoint_stops_a_recompute_with():
    stop = compat.stop_recomputation_error()
    assert issubclass(stop, Exception)
    seen = []

    class Rec:
        def __enter__(self):
            return self

        def __exit__(self, exc_type, *exc):
            seen.append(exc_type)

    def fn(x):
        return (x.sin() * 2).cos()  # the recompute stops after cos saves its input, before the end

    x = torch.randn(3, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(
        fn, x, use_reentrant=False, context_fn=lambda: (contextlib.nullcontext(), Rec())
    )
    y.sum().backward()
    assert seen and all(t is None or issubclass(t, stop) for t in seen), seen
    assert any(t is not None for t in seen), seen  # an early stop went through the recompute context


def test_dynamo_trace_errors_and_compile_counts():
    def breaks(x):
        y = x * 2
        warnings.warn("dynamo does not trace warnings.warn: a graph break", stacklevel=1)
        return y + 1

    torch.compiler.reset()
    try:
        with pytest.raises(compat.dynamo_trace_errors()):
            torch.compile(breaks, backend="eager", fullgraph=True)(torch.ones(2))
        torch.compiler.reset()
        with compat.compile_counts() as counts, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.compile(breaks, backend="eager")(torch.ones(2))
    finally:
        torch.compiler.reset()
    assert counts["graphs"] >= 1 and sum(counts["breaks"].values()) == 1, counts


def test_forward_side_effects_once():
    """A side effect in a checkpointed function compiled with its checkpoint: refused by dynamo without the flag,
    traced and run once per forward with it."""
    from torch.utils.checkpoint import checkpoint

    calls = []

    def body(x):
        calls.append(1)  # a Python side effect inside the checkpoint's higher-order op
        return x.sin()

    def step(x):
        return checkpoint(body, x, use_reentrant=False)

    x = torch.ones(3, requires_grad=True)
    torch.compiler.reset()
    try:
        with pytest.raises(compat.dynamo_trace_errors()):
            torch.compile(step, backend="eager", fullgraph=True)(x)
        torch.compiler.reset()
        calls.clear()
        with compat.forward_side_effects_once():
            y = torch.compile(step, backend="eager", fullgraph=True)(x)
        y.sum().backward()
    finally:
        torch.compiler.reset()
    assert calls == [1] and torch.equal(x.grad, torch.ones(3).cos())


def test_private_torch_apis_only_in_torch_compat():
    files = [p for p in sorted(LIBRARY.rglob("*.py")) if p.name != "_torch_compat.py"]
    assert LIBRARY / "parallel" / "param_sync.py" in files, LIBRARY  # the scan found the tree
    bad = [
        f"{path.relative_to(LIBRARY.parent)}:{line} uses {name}"
        for path in files
        for line, name in private_torch_uses(ast.parse(path.read_text(), filename=str(path)))
    ]
    assert not bad, "private torch APIs belong in distckpt/_torch_compat.py (with why and the version):\n" + "\n".join(
        bad
    )
    # The compat module itself uses them: the scan sees them there.
    assert private_torch_uses(ast.parse((LIBRARY / "_torch_compat.py").read_text()))


def test_private_scan_sees_a_planted_violation():
    planted = ast.parse(
        "import torch\nimport torch.nn as nn\nimport torch.utils.checkpoint as tuc\n"
        "from torch.utils._pytree import tree_map\nfrom torch import _C\nimport torch._dynamo\n"
        "from torch.utils.data import default_collate\n"
        "aten = torch.ops.aten\n"
        "def f(m, t):\n"
        "    from torch.distributed._tools.mem_tracker import MemTracker\n"
        "    isinstance(m, nn.modules.batchnorm._NormBase)\n"
        "    torch._C._will_engine_execute_node(t)\n"
        "    aten._scaled_dot_product_flash_attention_for_cpu\n"
        "    getattr(tuc, '_StopRecomputationError')\n"
        "    t._version, m._buffers, torch.__version__, torch.nn.functional.relu, aten.mm\n"
    )
    assert private_torch_uses(planted) == [
        (4, "torch.utils._pytree.tree_map"),
        (5, "torch._C"),
        (6, "torch._dynamo"),
        (10, "torch.distributed._tools.mem_tracker.MemTracker"),
        (11, "torch.nn.modules.batchnorm._NormBase"),
        (12, "torch._C"),
        (12, "torch._C._will_engine_execute_node"),
        (13, "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu"),
        (14, "torch.utils.checkpoint._StopRecomputationError"),
    ]


def test_pytree_and_norm_base():
    leaves, spec = compat.tree_flatten({"a": (torch.ones(1), 2), "b": [3]})
    assert leaves[1:] == [2, 3] and compat.tree_unflatten([0, 2, 3], spec) == {"a": (0, 2), "b": [3]}
    assert compat.tree_map(lambda x: x * 2, {"a": (1, 2)}) == {"a": (2, 4)}
    norm = compat.norm_base_class()
    for m in (nn.BatchNorm1d(2), nn.SyncBatchNorm(2), nn.InstanceNorm1d(2), nn.LazyBatchNorm1d()):
        assert isinstance(m, norm)
    assert not isinstance(nn.LayerNorm(2), norm)


def test_default_store_is_the_groups_store():
    import torch.distributed as dist

    from distckpt._spawn import host_store

    store = host_store()  # a TCPStore on a port the kernel picks
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        got = compat.default_store()
        assert isinstance(got, dist.Store)
        got.set("distckpt-probe", "1")
        assert got.get("distckpt-probe") == b"1" and got.add("distckpt-count", 2) == 2
    finally:
        dist.destroy_process_group()


def _fsdp2_flag(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0])
    fully_shard(model)
    seen = [compat.fsdp2_reduces_grads(model.modules())]
    model.set_requires_gradient_sync(False)  # what torch.distributed.pipelining sets for each micro-batch
    seen.append(compat.fsdp2_reduces_grads(model.modules()))
    model.set_requires_gradient_sync(True)
    seen.append(compat.fsdp2_reduces_grads(model.modules()))
    return seen, compat.fsdp2_reduces_grads([nn.Linear(2, 2)])  # not FSDP2: nothing turned off


def test_fsdp2_reduces_grads(dist_pool):
    assert dist_pool.run(_fsdp2_flag) == [([True, False, True], True)] * 2


class _Stop(Exception):
    pass


def _fake_stages(indices, num_stages=4, group_size=2):
    """Stand-ins for a rank's ``PipelineStage``s: what a schedule's constructor and the start of its ``step`` read."""
    from types import SimpleNamespace

    return [
        SimpleNamespace(
            num_stages=num_stages,
            group_size=group_size,
            group_rank=0,
            stage_index=i,
            is_first=i == 0,
            is_last=i == num_stages - 1,
            submod=nn.Linear(2, 2),
        )
        for i in indices
    ]


def test_running_pipeline_and_splits_backward():
    import torch.distributed.pipelining as pipelining

    def loss(out, target):
        return out.sum()

    stages = _fake_stages([0, 3])
    zbv = pipelining.ScheduleZBVZeroBubble(stages, 4, loss_fn=loss)
    split = {
        name: compat.splits_backward(getattr(pipelining, name)(_fake_stages([0, 2]), 4, loss_fn=loss))
        for name in ("ScheduleInterleavedZeroBubble", "ScheduleDualPipeV", "ScheduleInterleaved1F1B")
    }
    assert split == {"ScheduleInterleavedZeroBubble": True, "ScheduleDualPipeV": True, "ScheduleInterleaved1F1B": False}
    assert compat.splits_backward(zbv)

    # Inside step(): the schedule's first call into its stages (clear_runtime_states) sees it on the stack.
    seen = []

    def clear_runtime_states():
        seen.append(compat.running_pipeline())
        raise _Stop

    for stage in stages:
        stage.clear_runtime_states = clear_runtime_states
    with pytest.raises(_Stop):
        zbv.step(torch.zeros(4, 2), target=torch.zeros(4, 2))
    assert seen == [(zbv, None)]  # no PipelineStage method on the stack here: a stand-in's
    assert compat.running_pipeline() is None
