"""The typed parallel layout: built and checked once from a strategy name (distckpt.layout.Layout.of), then read as
data (engine, sharding, shard groups, mesh dimensions) everywhere else."""

from __future__ import annotations

import dataclasses

import pytest

from distckpt import ConfigError
from distckpt.layout import CompileOptions, Layout, default_shard_size
from distckpt.options import STRATEGIES, Engine, check_run, check_tp, engine_of


@pytest.mark.parametrize(
    "strategy, engine, sharded, shards, dims",
    [
        ("none", Engine.NONE, False, 1, ()),
        ("ddp", Engine.DDP, False, 1, (("dp", 4),)),
        ("fsdp", Engine.FSDP1, True, 4, (("dp", 4),)),
        ("fsdp2", Engine.FSDP2, True, 4, (("dp", 4),)),
        ("hsdp", Engine.FSDP2, True, 2, (("replicate", 2), ("shard", 2))),
    ],
)
def test_each_strategy_reads_as_data(strategy, engine, sharded, shards, dims):
    layout = Layout.of(strategy, world_size=4, shard_size=2 if strategy == "hsdp" else None)
    assert (layout.engine, layout.sharded, layout.shards, layout.mesh_dims) == (engine, sharded, shards, dims)
    assert layout.world_size == (1 if strategy == "none" else 4)
    assert engine_of(strategy) is engine
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.strategy = "ddp"


def test_every_strategy_name_has_an_engine():
    assert {engine_of(s) for s in STRATEGIES} == set(Engine)


def test_shard_size_rules_are_checked_once_at_construction(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="is for strategy='hsdp'"):
        Layout.of("fsdp2", world_size=4, shard_size=2)
    with pytest.raises(ConfigError, match="does not divide the world size 4"):
        Layout.of("hsdp", world_size=4, shard_size=3)
    with pytest.raises(ConfigError, match="needs shard_size=N"):
        Layout.of("hsdp", world_size=4)
    with pytest.raises(ConfigError, match="strategy must be one of"):
        Layout.of("zero3", world_size=4)
    # The one default: the ranks of one node, as torchrun says them.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert Layout.of("hsdp", world_size=8).shard_size == 2
    assert default_shard_size() == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert default_shard_size(fallback=8) == 8 and default_shard_size() is None


def test_a_layout_is_not_given_twice():
    layout = Layout.of("hsdp", world_size=4, shard_size=2, compile=True)
    assert Layout.of(layout) is layout
    assert layout.compile == CompileOptions()
    with pytest.raises(ConfigError, match="already says them"):
        Layout.of(layout, shard_size=2)
    with pytest.raises(ConfigError, match="strategy name or a distckpt Layout"):
        Layout.of(4)


def test_describe_names_the_mesh():
    assert Layout.of("hsdp", world_size=4, shard_size=2).describe() == "hsdp over 4 ranks (mesh 2 replicate x 2 shard)"
    assert Layout.of("ddp", world_size=2).describe() == "ddp over 2 ranks"
    assert Layout.of("none").describe() == "one process"


def test_tensor_parallel_is_one_more_field():
    layout = Layout.of("fsdp2", world_size=2, tp=2)
    assert (layout.tp, layout.ranks, layout.shards) == (2, 4, 2)  # FSDP2 shards over the 2 data-parallel ranks
    assert layout.mesh_dims == (("dp", 2), ("tp", 2))
    assert layout.describe() == "fsdp2 over 2 ranks x tp 2 (mesh 2 dp x 2 tp)"
    assert Layout.of("fsdp2", world_size=4).tp == 1
    for strategy in ("ddp", "fsdp", "hsdp", "none"):
        with pytest.raises(ConfigError, match="runs with strategy='fsdp2' only"):
            Layout.of(strategy, world_size=2, shard_size=2 if strategy == "hsdp" else None, tp=2)
    with pytest.raises(ConfigError, match="positive int"):
        Layout.of("fsdp2", world_size=2, tp=0)
    with pytest.raises(ConfigError, match="already says them"):
        Layout.of(layout, tp=2)
    check_tp(2, "fsdp2", world_size=4)
    with pytest.raises(ConfigError, match="tp=3 does not divide the 4 ranks"):
        check_tp(3, "fsdp2", world_size=4)


def test_the_rules_take_strategy_names_at_the_boundary():
    # check_run (the launcher's and the library's rule) reads the name once; its refusals are per engine.
    with pytest.raises(ConfigError, match="FSDP1"):
        check_run("fsdp", reentrant=True)
    check_run("fsdp2", reentrant=True)
    with pytest.raises(ConfigError, match="static_graph"):
        check_run("ddp", reentrant=True, accumulate=True)
