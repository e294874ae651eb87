"""The memory benchmark's measurements that make its rows comparable (benchmarks/memory.py, measured with
tests/peaks.py, its frontier in tests/frontier.py): the profiler-based peak used for every row equals
MemTracker's on an eager step, FLOPs (CPU attention included) of a compiled step are counted inside its
graphs, and the dominance check reads both axes."""

from __future__ import annotations

import torch
from frontier import Config, budget_configs, dominance, dominated_by
from models import GPT, GPTConfig, batch
from peaks import CompiledBudget, fwd_bwd_flops, mem_tracker_peak, profiled_peak, train_step
from torch.utils.flop_counter import FlopCounterMode

from distckpt import _torch_compat as compat
from distckpt.select.profile import scalar_loss

CFG = GPTConfig(vocab=64, seq=16, dim=32, heads=2, layers=2)  # small: a torch.compile takes seconds


def _tiny():
    torch.manual_seed(0)
    model = GPT(CFG).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inputs = batch(CFG, 2)
    train_step(model, opt, inputs, {})  # the optimizer state exists: steady state
    return model, opt, inputs


def test_profiled_peak_equals_mem_tracker_on_an_eager_step():
    model, opt, inputs = _tiny()
    assert profiled_peak(model, opt, inputs, {}) == mem_tracker_peak(model, opt, inputs, {}, torch.device("cpu"))


def test_compiled_flops_are_counted_inside_the_graphs():
    model, _, inputs = _tiny()
    eager = fwd_bwd_flops(model, inputs, {})
    with FlopCounterMode(display=False) as plain:  # torch 2.13's own counter: no CPU attention
        scalar_loss(model(*inputs)).backward()
    model.zero_grad(set_to_none=True)
    forward, backward = compat.sdpa_flop_count_fns()
    q = (2, CFG.heads, CFG.seq, CFG.dim // CFG.heads)  # batch 2: each layer's causal attention
    assert eager - plain.get_total_flops() == CFG.layers * (forward(q, q, q) + backward(q, q, q, q)) > 0
    compiled = CompiledBudget(model, 1.0)  # no budget pressure: no matmul is recomputed
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-4)
    train_step(compiled, opt, inputs, {})
    assert fwd_bwd_flops(compiled, inputs, {}) == eager
    assert compiled.graph_flops.graphs == 2  # one forward graph, one backward graph


def _point(name, peak, flops, kind="budget"):
    c = Config(name, lambda m: m, kind=kind)
    c.peak, c.flops = peak, flops
    return c


def test_dominated_by_needs_both_axes():
    frontier = [_point("a", 100, 50), _point("b", 80, 90)]
    assert dominated_by(_point("p", 100, 60, "peer"), frontier, 1000, 1000).name == "a"
    assert dominated_by(_point("p", 85, 95, "peer"), frontier, 1000, 1000).name == "b"
    assert dominated_by(_point("p", 90, 60, "peer"), frontier, 1000, 1000) is None  # less memory than a
    assert dominated_by(_point("p", 101, 40, "peer"), frontier, 1000, 1000) is None  # less recompute than a
    assert dominated_by(_point("p", 99.5, 50.5, "peer"), frontier, 1000, 1000).name == "a"  # within 0.1%


def test_budget_points_at_every_other_points_peak():
    others = [
        _point("torch full", 300, 9, "peer"),
        _point("full", 300, 9, "distckpt"),
        _point("compile 0.5", 420, 1, "compile"),
        _point("too small", 50, 0, "compile"),
    ]
    points = budget_configs(100, 1000, None, 3, others)
    assert [(c.budget, c.at) for c in points] == [
        (100, ""),
        (300, "torch full = full"),
        (420, "compile 0.5"),
        (550, ""),
        (1000, ""),
    ]
    assert all(c.kind == "budget" for c in points)


def test_an_undominated_point_shows_the_budget_at_its_peak():
    none, peer = _point("none", 1000, 0, "distckpt"), _point("compile 0.5", 600, 10, "compile")
    at = _point("budget 0.00 MiB", 590, 40)
    at.at = "compile 0.5"
    rows = dominance("m", [none, peer, at], 1000)
    want = (
        "| compile 0.5 | 60.0% | 1.0% | **no**: budget 0.00 MiB, sized at its peak, measured 59.0% at 4.0% recompute |"
    )
    assert want in rows, rows
