"""parallelize / ddp_kwargs / accumulate in one process: argument checks, and the zero-weight join on its own."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from patterns import PATTERNS, Block, build

import distckpt
from distckpt import ConfigError
from distckpt.layout import Layout
from distckpt.parallel.param_sync import _Participate


def _wrapped(reentrant: bool = False) -> nn.Module:
    model = build(PATTERNS["all_heads"])
    return distckpt.wrap(model, "full", blocks=Block, reentrant=reentrant)


def test_unknown_strategy_and_graph():
    with pytest.raises(ConfigError, match="strategy must be one of"):
        distckpt.parallelize(_wrapped(), "zero3")
    with pytest.raises(ConfigError, match="graph must be one of"):
        distckpt.parallelize(_wrapped(), "ddp", graph="sometimes")


def test_none_returns_model():
    model = _wrapped()
    assert distckpt.parallelize(model, "none") is model


def test_needs_process_group():
    assert not torch.distributed.is_initialized()
    with pytest.raises(ConfigError, match="torchrun"):
        distckpt.parallelize(_wrapped(), "ddp")


def test_ddp_kwargs():
    assert distckpt.ddp_kwargs(_wrapped(), graph="static") == {"find_unused_parameters": False, "static_graph": True}
    assert distckpt.ddp_kwargs(_wrapped(), graph="auto") == {"find_unused_parameters": True, "static_graph": False}
    assert distckpt.ddp_kwargs(_wrapped(True), graph="static")["static_graph"] is True
    with pytest.raises(ConfigError, match="reentrant=False"):
        distckpt.ddp_kwargs(_wrapped(True), graph="dynamic")


def test_accumulate_plain_model_is_a_no_op():
    model = _wrapped()
    with distckpt.accumulate(model):
        model(torch.randn(2, 4))["a"].sum().backward()
    assert model.heads.a.weight.grad is not None


def test_join_gives_zero_not_nan_to_unused_params():
    """An unused param full of inf gets a zero gradient from the join (``0 * p.sum()`` would give NaN)."""

    class _State:
        def on_participate_backward(self, rec, keys):
            return [False] * len(keys)  # nothing used: zeros for all

    p = nn.Parameter(torch.full((3,), float("inf")))
    x = torch.randn(2, requires_grad=True)
    out = _Participate.apply(_State(), None, [None], x * 2, p)
    assert not out._is_view()  # FSDP2 warns about view outputs
    out.sum().backward()
    assert torch.equal(p.grad, torch.zeros(3))
    assert torch.equal(x.grad, torch.full((2,), 2.0))


def test_end_of_step_check_names_a_unit_run_unequally_across_ranks(monkeypatch):
    """The end-of-step all-reduce carries each FSDP unit's forward count and order: a unit that ran a
    different number of times on another rank raises GradDesyncError naming it and the fix."""
    from distckpt.parallel.param_sync import SyncState, _Unit

    block, root = nn.Linear(2, 2), nn.Linear(2, 2)
    state = SyncState(["w"], [nn.Parameter(torch.zeros(1))], "join", None, Layout.of("fsdp2", world_size=2), set())
    state.attach(_Unit(block, [], "layers.0.mlps.1"), True)
    state.attach(_Unit(root, [], ""), True)
    other_rank = torch.tensor([0, 2, 1, 5, -2, -1, -5])  # used bits, calls (unit, root, order), negated

    def fake_allreduce(t, op=None):  # MAX over this rank and the other
        return torch.maximum(t, other_rank)

    monkeypatch.setattr(state, "_allreduce", fake_allreduce)
    state._calls, state._order = [1, 1], 5
    with pytest.raises(distckpt.GradDesyncError, match=r"layers\.0\.mlps\.1 ran 1 to 2 times.*contains the router"):
        state._reduce_window(torch.zeros(1, dtype=torch.bool))
    state._calls, state._order = [2, 1], 5
    assert state._reduce_window(torch.zeros(1, dtype=torch.bool)).tolist() == [False]  # equal: fine
