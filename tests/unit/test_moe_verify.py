"""verify_recompute names a routing mismatch as its own cause (issue 34): ``[routing]``, at the router module, with
the fix; integer outputs are compared element by element (a permutation of top-k indices has the same sum)."""

from __future__ import annotations

import moe_sim as sim
import pytest
import torch
import torch.nn as nn

import distckpt
from distckpt.check.op_record import CAUSES


def _verify(model: nn.Module, b: dict, noise: str | None, replay: bool) -> distckpt.check.recompute.RecomputeReport:
    def loss_fn(m: nn.Module) -> torch.Tensor:
        if noise is not None:
            sim.reset_noise(model)  # both runs with the forward's perturbation
        return sim.loss(m, b)

    if replay:
        return distckpt.verify_recompute(model, loss_fn, raise_on_mismatch=False)
    with distckpt.routing_replay_disabled(model):
        return distckpt.verify_recompute(model, loss_fn, raise_on_mismatch=False)


@pytest.mark.parametrize("policy", ["full", pytest.param("selective", marks=pytest.mark.slow)])
@pytest.mark.parametrize("source", ["counter", pytest.param("generator", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", sim.MODELS)
def test_routing_is_named_at_the_router_when_replay_is_off(name, source, policy):
    model = sim.build(name, noise=source)
    distckpt.wrap(model, policy)
    report = _verify(model, sim.batch(name, tokens=128), source, replay=False)
    first = report.mismatches[0]
    assert first.kind == "routing", str(report)
    assert first.module in dict(sim.routers(model)), first.module  # the router, not mlp.experts
    assert "rows (tokens) got other indices" in first.detail and "upstream" in first.detail, first.detail
    assert first.cause == CAUSES["routing"] and "routing_replay_disabled" in first.cause
    assert "[routing]" in str(report)


@pytest.mark.parametrize("name", sim.MODELS)
def test_with_replay_and_no_perturbation_the_recompute_is_exact(name):
    model = sim.build(name)
    distckpt.wrap(model, "full")
    report = _verify(model, sim.batch(name, tokens=128), None, replay=True)
    assert report.ok, str(report)


def test_selective_without_replay_reports_the_routing_before_the_recompute_error():
    """The issue's "raw shape error" (selective, an expert loop): the recompute fails inside itself (a saved
    matmul output beside tensors of other shapes); verify reports the routing first, then that error."""
    model = sim.build("mixtral_eager", noise="kernel")
    distckpt.wrap(model, "selective")
    report = _verify(model, sim.batch("mixtral_eager", tokens=128), "kernel", replay=False)
    kinds = [m.kind for m in report.mismatches]
    assert kinds[0] == "routing" and "checkpoint_error" in kinds, str(report)


class _TiedPair(nn.Module):
    """Experts 0 and 1 always win (a large bias) with equal scores up to a call-dependent 1e-6: the recompute swaps
    their order. Indices per token {0, 1} in either order: the same sum and sum of squares."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4)
        with torch.no_grad():
            self.router.weight[1] = self.router.weight[0]
            self.router.bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        scores = self.router(x) + torch.tensor([1e-6, 0.0, 0.0, 0.0]) * (-1) ** self.calls
        weights, idx = scores.softmax(-1).topk(2, dim=-1)
        return x * weights.sum(-1, keepdim=True) + idx.float().mean()


def test_a_permutation_of_top_k_indices_is_caught():
    model = nn.Sequential(_TiedPair())
    distckpt.wrap(model, "full", blocks=[_TiedPair])
    x = torch.randn(6, 8)
    with distckpt.routing_replay_disabled(model):
        report = distckpt.verify_recompute(model, lambda m: m(x).sum(), raise_on_mismatch=False)
    routing = [m for m in report.mismatches if m.kind == "routing"]
    assert routing and routing[0].module == "0.router" and "6 of 6 rows" in routing[0].detail, str(report)
    # With replay (the default) the recompute reuses the forward's order: only the counter's add differs.
    report = distckpt.verify_recompute(model, lambda m: m(x).sum(), raise_on_mismatch=False)
    assert not [m for m in report.mismatches if m.kind == "routing"], str(report)


def test_integer_outputs_compare_element_by_element():
    from distckpt.check.op_record import _op_record, _values_differ

    a = _op_record("aten::topk", "r", (torch.ones(2, 2), torch.tensor([[0, 1], [1, 0]])))
    b = _op_record("aten::topk", "r", (torch.ones(2, 2), torch.tensor([[1, 0], [1, 0]])))
    assert a.values[1][2:4] == b.values[1][2:4]  # the same sum and sum of squares
    assert _values_differ(a.values[1], b.values[1], 1e-5) and not _values_differ(a.values[0], b.values[0], 1e-5)
