"""parallelize under DDP, FSDP and FSDP2: every multi-task pattern against the single-process
reference without checkpointing (AdamW with weight decay, 3 steps), or a ConfigError naming the fix."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from harness import RankError
from patterns import PATTERNS, Block, HeadBlock, LoraBlock, batch, build, make_optimizer, reference, shard

import distckpt
from distckpt.wrap import _clean_fqn

STEPS = 3
_BLOCKS = (Block, LoraBlock, HeadBlock)


def _full_grads(pm, strategy):
    if strategy == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        # What the optimizer sees is each rank's shard of the original params: a grad is None when
        # it is None on every rank holding part of the param; the values come from summon_full_params.
        named = [(n, p) for n, p in pm.named_parameters() if p.requires_grad]
        has = torch.tensor([[p.grad is not None, p.grad is None and p.numel() > 0] for _, p in named],
                           dtype=torch.int32)
        dist.all_reduce(has)
        assert not (has[:, 0] > 0).logical_and(has[:, 1] > 0).any(), "grad None on some shards only"
        with FSDP.summon_full_params(pm, with_grads=True):
            got = {_clean_fqn(n): p.grad for n, p in pm.named_parameters()}
            return {_clean_fqn(n): None if not has[i, 0] else got[_clean_fqn(n)].detach().clone()
                    for i, (n, _) in enumerate(named)}
    out = {}
    for n, p in pm.named_parameters():
        if not p.requires_grad:
            continue
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[_clean_fqn(n)] = None if g is None else g.detach().clone()
    return out


def _full_params(pm, strategy):
    if strategy == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(pm):
            return {_clean_fqn(n): p.detach().clone() for n, p in pm.named_parameters()}
    return {_clean_fqn(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in pm.named_parameters()}


def _train(rank, world_size, name, strategy, reentrant, graph, steps=STEPS, kwargs=None):
    pattern = PATTERNS[name]
    model = build(pattern)
    distckpt.wrap(model, "full", blocks=lambda m: isinstance(m, _BLOCKS), reentrant=reentrant)
    pm = distckpt.parallelize(model, strategy, graph=graph, **(kwargs or {}))
    opt = make_optimizer([p for p in pm.parameters() if p.requires_grad])
    grads = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        for micro in range(pattern.micro_batches):
            x = shard(batch(step, micro), rank, world_size)
            last = micro == pattern.micro_batches - 1
            with contextlib.nullcontext() if last else distckpt.accumulate(pm):
                local_step = step * pattern.micro_batches + micro
                (pattern.loss(pm, x, local_step, rank) / pattern.micro_batches).backward()
        grads.append(_full_grads(pm, strategy))
        opt.step()
    return grads, _full_params(pm, strategy)


def _config_error(rank, world_size, body, *args, **kwargs):
    """Run ``body`` and return the ConfigError message it raised (None if none): catching it on the rank
    keeps the pool alive (every rank raises it at the same point, so no collective is left pending)."""
    try:
        body(rank, world_size, *args, **kwargs)
    except distckpt.ConfigError as e:
        return str(e)
    return None


_REF: dict = {}


def _reference(name):
    if name not in _REF:
        _REF[name] = reference(PATTERNS[name], world_size=2, steps=STEPS)
    return _REF[name]


def _assert_matches(results, name):
    ref_grads, ref_params = _reference(name)
    (g0, p0), (g1, p1) = results
    for step, (rg, a, b) in enumerate(zip(ref_grads, g0, g1)):
        assert a.keys() == rg.keys()
        for n, r in rg.items():
            assert (a[n] is None) == (r is None), f"step {step} {n}: grad None on reference={r is None}"
            assert (b[n] is None) == (r is None), f"step {step} {n}: rank 1 grad None differs"
            if r is not None:
                assert torch.equal(a[n], b[n]), f"step {step} {n}: ranks differ"
                torch.testing.assert_close(a[n], r, rtol=1e-5, atol=1e-6, msg=f"step {step} {n}")
    for n, r in ref_params.items():
        assert torch.equal(p0[n], p1[n]), f"{n}: params differ across ranks"
        torch.testing.assert_close(p0[n], r, rtol=1e-5, atol=1e-6, msg=n)


# Patterns with no safe setting under reentrant checkpointing with DDP (under FSDP1 parallelize refuses
# reentrant blocks; under FSDP2 every pattern is correct), and the fix ConfigError must name.
_REENTRANT_REFUSED = {
    # heads inside a reentrant block: the block's nested backward gives some heads no gradient on some
    # ranks, and DDP needs static_graph for reentrant blocks (pytorch#121594).
    "heads_inside": "reentrant=False",
    # DDP static_graph (needed for reentrant blocks) cannot skip sync on a micro-batch.
    "accumulate": "reentrant=False",
}


@pytest.mark.dist
@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "fsdp"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_pattern(dist_pool, name, strategy, reentrant):
    """graph='auto': equal to the reference, identical across ranks; or ConfigError before the first step."""
    if name == "loss_only_param" and strategy != "ddp":
        pytest.skip("FSDP shards parameters outside forward: a loss-only parameter cannot be read there")
    refused = reentrant and (strategy == "fsdp" or (strategy == "ddp" and name in _REENTRANT_REFUSED))
    if not refused:
        _assert_matches(dist_pool.run(_train, name, strategy, reentrant, "auto", timeout=60), name)
        return
    if strategy == "fsdp" and name != "all_heads":
        pytest.skip("refused by parallelize itself, whatever the pattern: tested once, on all_heads")
    # One step: the error comes before the first optimizer step.
    msgs = dist_pool.run(_config_error, _train, name, strategy, reentrant, "auto", 1, timeout=60)
    assert all(m is not None and "reentrant=False" in m for m in msgs), msgs


# --- graph="static" / "dynamic" ------------------------------------------------------------------

_STATIC = [n for n, p in PATTERNS.items() if p.static]


@pytest.mark.dist
@pytest.mark.parametrize("name", _STATIC)
def test_static_graph_ddp(dist_pool, name):
    _assert_matches(dist_pool.run(_train, name, "ddp", False, "static", timeout=60), name)


def _is_static(rank, world_size):
    model = build(PATTERNS["all_heads"])
    distckpt.wrap(model, "full", blocks=lambda m: isinstance(m, _BLOCKS))
    pm = distckpt.parallelize(model, "ddp", graph="static")
    return pm.static_graph, pm.find_unused_parameters


@pytest.mark.dist
def test_static_graph_flags(dist_pool):
    assert dist_pool.run(_is_static) == [(True, False)] * 2


@pytest.mark.dist
@pytest.mark.parametrize(("name", "strategy", "bad_step"), [
    # DDP's static graph sends a zero through every output on its first step (its _DDPSink), so a head
    # computed but not in the loss is seen on the second step: still before it changes anything.
    ("unused_output", "ddp", 1), ("by_rank", "ddp", 0), ("by_step", "ddp", 1),
    ("by_step", "fsdp2", 1), ("unused_output", "fsdp", 0),
])
def test_static_graph_refuses_changing_graph(dist_pool, name, strategy, bad_step):
    """ConfigError at the first step whose used parameters differ, before that step's optimizer step."""
    if bad_step:  # the steps before it train correctly
        assert dist_pool.run(_config_error, _train, name, strategy, False, "static", bad_step) == [None, None]
    msgs = dist_pool.run(_config_error, _train, name, strategy, False, "static", bad_step + 1, timeout=60)
    assert all(m is not None and "graph='auto'" in m and f"step {bad_step}" in m for m in msgs), msgs


@pytest.mark.dist
@pytest.mark.parametrize("name", ["by_rank", "sampled", "two_forwards"])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_dynamic_graph(dist_pool, name, strategy):
    _assert_matches(dist_pool.run(_train, name, strategy, False, "dynamic", timeout=60), name)


# --- kwargs pass through, or ConfigError when they contradict correctness -------------------------


@pytest.mark.dist
@pytest.mark.parametrize(("strategy", "kwargs"), [
    ("ddp", {"bucket_cap_mb": 1, "gradient_as_bucket_view": True}),
    ("fsdp2", {"reshard_after_forward": False}),
    ("fsdp", {"limit_all_gathers": False}),
])
def test_kwargs_pass_through(dist_pool, strategy, kwargs):
    _assert_matches(dist_pool.run(_train, "sampled", strategy, False, "auto", kwargs=kwargs, timeout=60), "sampled")


@pytest.mark.dist
@pytest.mark.parametrize(("strategy", "graph", "kwargs", "fix"), [
    ("ddp", "auto", {"find_unused_parameters": True}, "Remove it"),
    ("ddp", "dynamic", {"static_graph": True}, "Remove static_graph"),
    ("ddp", "static", {"static_graph": False}, "Remove static_graph"),
    ("fsdp", "auto", {"use_orig_params": False}, "Remove use_orig_params"),
    ("fsdp", "auto", {"auto_wrap_policy": None}, "Remove it"),
    ("fsdp2", "auto", {"mesh": None}, "device_mesh=mesh"),
])
def test_contradicting_kwargs(dist_pool, strategy, graph, kwargs, fix):
    msgs = dist_pool.run(_config_error, _train, "all_heads", strategy, False, graph, 1, kwargs=kwargs, timeout=60)
    assert all(m is not None and fix in m for m in msgs), msgs


def _parallelize_twice(rank, world_size, strategy):
    model = build(PATTERNS["all_heads"])
    distckpt.wrap(model, "full", blocks=lambda m: isinstance(m, _BLOCKS))
    pm = distckpt.parallelize(model, strategy)
    distckpt.parallelize(pm, strategy)


@pytest.mark.dist
def test_parallelize_refuses_wrapped_model(dist_pool):
    msgs = dist_pool.run(_config_error, _parallelize_twice, "ddp")
    assert all(m is not None and "already wrapped" in m for m in msgs), msgs


# --- what the join fixes: plain DDP on the same patterns ---------------------------------------


def _plain_ddp(rank, world_size, name, flags):
    from torch.nn.parallel import DistributedDataParallel as DDP

    pattern = PATTERNS[name]
    model = build(pattern)
    distckpt.wrap(model, "full", blocks=lambda m: isinstance(m, _BLOCKS))
    pm = DDP(model, **flags)
    for step in range(2):
        pattern.loss(pm, shard(batch(step, 0), rank, world_size), step, rank).backward()


@pytest.mark.dist
@pytest.mark.parametrize(("name", "flags", "text"), [
    ("by_rank", {}, "Expected to have finished reduction in the prior iteration"),
    ("two_forwards", {"find_unused_parameters": True}, "Expected to mark a variable ready only once"),
])
def test_plain_ddp_fails_where_parallelize_works(dist_pool, name, flags, text):
    """The control for test_pattern: without distckpt's join, DDP raises its own errors on these patterns."""
    with pytest.raises(RankError) as e:
        dist_pool.run(_plain_ddp, name, flags, timeout=60)
    assert text in e.value.messages()


# --- preflight and ddp_kwargs on user-built wrappers ---------------------------------------------


def _user_ddp(rank, world_size, reentrant, flags):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build(PATTERNS["all_heads"])
    distckpt.wrap(model, "full", blocks=lambda m: isinstance(m, _BLOCKS), reentrant=reentrant)
    distckpt.preflight(DDP(model, **(flags if flags is not None else distckpt.ddp_kwargs(model, graph="static"))))
    return True


def _user_fsdp_root_only(rank, world_size):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = build(PATTERNS["all_heads"])
    distckpt.wrap(model, "full", blocks=lambda m: isinstance(m, _BLOCKS))
    distckpt.preflight(FSDP(model, device_id=torch.device("cpu"), use_orig_params=True))


def _checkpoint_around_fsdp(rank, world_size):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = build(PATTERNS["all_heads"])
    model.blocks[0] = checkpoint_wrapper(FSDP(model.blocks[0], device_id=torch.device("cpu")))
    distckpt.preflight(model)


def _preflight_parallelized(rank, world_size, strategy):
    model = build(PATTERNS["all_heads"])
    distckpt.wrap(model, "full", blocks=lambda m: isinstance(m, _BLOCKS), reentrant=strategy == "ddp")
    distckpt.preflight(distckpt.parallelize(model, strategy))
    return True


@pytest.mark.dist
@pytest.mark.parametrize(("body", "args", "text"), [
    (_user_ddp, (True, {"find_unused_parameters": True}), "ready only once"),
    (_user_ddp, (True, {}), "pytorch#121594"),
    (_user_fsdp_root_only, (), "not inside its own FSDP unit"),
    (_checkpoint_around_fsdp, (), "pytorch#82203"),
])
def test_preflight_refuses(dist_pool, body, args, text):
    msgs = dist_pool.run(_config_error, body, *args, timeout=60)
    assert all(m is not None and text in m for m in msgs), msgs


@pytest.mark.dist
def test_preflight_accepts(dist_pool):
    assert dist_pool.run(_user_ddp, True, None) == [True, True]  # ddp_kwargs(graph="static") is safe
    for strategy in ("ddp", "fsdp", "fsdp2"):
        assert dist_pool.run(_preflight_parallelized, strategy) == [True, True]


def _names_and_eval(rank, world_size, strategy):
    pattern = PATTERNS["all_heads"]
    plain = build(pattern)
    keys = list(plain.state_dict())
    model = build(pattern)
    distckpt.wrap(model, "full", blocks=lambda m: isinstance(m, _BLOCKS))
    pm = distckpt.parallelize(model, strategy)
    x = shard(batch(0, 0), rank, world_size)
    with torch.no_grad():  # evaluation: no join, no records kept
        out = pm(x)
    state = pm._distckpt_sync
    assert state.forwards == 0 and not state.consumers
    ref = plain(x)
    same = all(torch.allclose(out[t], ref[t], atol=1e-6) for t in out)
    names = [_clean_fqn(n) for n in (pm.module if strategy == "ddp" else pm).state_dict()]
    return same, names == keys


@pytest.mark.dist
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_eval_and_state_dict_keys(dist_pool, strategy):
    """Under no_grad the model runs plainly; state_dict keys are the unwrapped model's."""
    assert dist_pool.run(_names_and_eval, strategy) == [(True, True)] * 2
