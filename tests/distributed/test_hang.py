"""Never a hang (issue 31): ranks that run different forwards, on 2 and 4 gloo ranks, each against the single-process
reference without checkpointing. Under FSDP/FSDP2/HSDP a forward one rank runs alone is refused by the handshake on
every rank at the first such step (before it, the steps are exact); under DDP it is exact, BatchNorm included (its
running statistics: rank 0's, synced once per step); DDP that syncs buffers at every forward because the user asked
is refused the same way. Every call has a timeout, so a hang fails the test instead of stalling the suite."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
from harness import DistPool
from patterns import (
    RANK_FORWARDS,
    Block,
    Buffered,
    Pattern,
    assert_matches,
    build,
    full_grads,
    make_optimizer,
    micro_batches,
    reference,
    train_parallel,
)

import distckpt

pytestmark = pytest.mark.dist

STEPS = 3
CALL_S = 60  # a hang (the behaviour before the handshake) fails the call after this long; a refusal takes seconds


@pytest.fixture(scope="module")
def pool4():
    pool = DistPool(world_size=4, timeout=180)
    pool.run(_started, timeout=300)  # the ranks' start (imports: up to a minute on a loaded machine) out of CALL_S
    yield pool
    pool.close()


def _started(rank, world_size):
    return rank


# --- the parallel runs ------------------------------------------------------------------------------------------------


def _parallel(model, strategy, kwargs):
    if strategy == "hsdp":
        return distckpt.parallelize(model, "hsdp", shard_size=2, **kwargs)
    return distckpt.parallelize(model, strategy, **kwargs)


def _outcome(rank, world_size, pattern, strategy, kwargs=None, evaluate_on=None):
    """("ok", grads per step) or ("refused", message, step, grads of the steps before). With ``evaluate_on``, that
    rank alone runs a forward without gradients before each step after the first (evaluation on rank 0 only)."""
    model = build(pattern)
    distckpt.wrap(model, "full", blocks=pattern.blocks)
    pm = _parallel(model, strategy, kwargs or {})
    kind = "fsdp2" if strategy == "hsdp" else strategy
    opt = make_optimizer([p for p in pm.parameters() if p.requires_grad])
    grads = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        try:
            xs = micro_batches(pattern, step, rank, world_size)
            if rank == evaluate_on and step > 0:
                with torch.no_grad():
                    pm(xs[0])
            pattern.schedule(pm, pattern.loss, xs, step, rank, lambda: distckpt.accumulate(pm), 1.0)
        except distckpt.ConfigError as e:
            return ("refused", str(e), step, grads)
        grads.append(full_grads(pm, kind))
        opt.step()
    return ("ok", grads)


def _assert_refused_at_step_1(out, ranks, pattern, world_size, strategy):
    """Every rank raised the same ConfigError at step 1 (the first step whose forwards differ), naming each rank's
    phase and the fix; step 0 was exact."""
    ref_grads, _ = reference(pattern, world_size=world_size, steps=1)
    assert all(o[0] == "refused" and o[2] == 1 for o in out), [o[:3] for o in out]
    messages = {o[1] for o in out}
    assert len(messages) == 1, messages  # the same error on every rank
    msg = messages.pop()
    assert ranks in msg and f"Under {strategy}" in msg and "strategy='ddp'" in msg, msg
    for o in out:
        (got,) = o[3]
        for n, r in ref_grads[0].items():
            assert (got[n] is None) == (r is None), n
            if r is not None:
                torch.testing.assert_close(got[n], r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("strategy", "kwargs"),
    [("fsdp", {}), ("fsdp2", {}), ("fsdp2", {"reshard_after_forward": False})],
    ids=["fsdp", "fsdp2", "fsdp2-no-reshard"],
)
def test_sharded_lone_forward_refused_on_every_rank(dist_pool, strategy, kwargs):
    """Rank 1 runs a second task's forward on odd steps. Before the handshake: a hang (one rank in reduce_scatter, the
    other in all_gather). Now: ConfigError on both ranks at step 1, at rank 1's extra forward."""
    out = dist_pool.run(_outcome, RANK_FORWARDS, strategy, kwargs, timeout=CALL_S)
    _assert_refused_at_step_1(
        out,
        "rank 0 began backward 1 of step 1, after 1 forward; rank 1 began forward 2 of step 1",
        RANK_FORWARDS,
        2,
        strategy,
    )


@pytest.mark.parametrize("strategy", ["hsdp", "fsdp2"])
def test_sharded_lone_forward_refused_on_4_ranks(pool4, strategy):
    """The same on 4 ranks: HSDP on a 2x2 mesh, FSDP2 over all four."""
    out = pool4.run(_outcome, RANK_FORWARDS, strategy, timeout=CALL_S)
    _assert_refused_at_step_1(
        out,
        "ranks 0, 2, 3 began backward 1 of step 1, after 1 forward; rank 1 began forward 2 of step 1",
        RANK_FORWARDS,
        4,
        strategy,
    )


def test_evaluation_on_one_rank_refused_under_fsdp2(dist_pool):
    """A forward without gradients on rank 0 alone (evaluation) all-gathers alone under FSDP2: refused too."""
    pattern = Pattern("all_heads_only", _first_head, {}, model=Buffered)
    out = dist_pool.run(_outcome, pattern, "fsdp2", evaluate_on=0, timeout=CALL_S)
    assert all(o[0] == "refused" and o[2] == 1 for o in out), [o[:3] for o in out]
    assert (
        "rank 0 began forward 1 of step 1 without gradients (evaluation); rank 1 began forward 1 of step 1"
        in (out[0][1])
    ), out[0][1]


def _first_head(model, x, step, rank):
    return (model(x, ("a",))["a"].squeeze(-1) - x.sum(-1)).pow(2).mean()


# --- BatchNorm under DDP ----------------------------------------------------------------------------------------------


class NormBlock(Block):
    """A block whose hidden layer keeps running statistics."""

    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(self.fc1.out_features)

    def forward(self, x):
        # After the nonlinearity: a bias right before BatchNorm has a true gradient of zero, compared in noise only.
        return x + self.fc2(self.norm(torch.tanh(self.fc1(x))))


class Normed(Buffered):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.blocks = nn.ModuleList([NormBlock() for _ in self.blocks])


def _wide(x):
    # Twice the rows (4 on each of 4 ranks): BatchNorm's statistics over 2 rows leave gradients in float32 noise.
    return torch.cat([x, 0.7 * x.roll(1, -1)])


def _bn_rank_forwards(model, x, step, rank):
    return RANK_FORWARDS.loss(model, _wide(x), step, rank)


def _bn_equal(model, x, step, rank):
    return _first_head(model, _wide(x), step, rank)


BN_FORWARDS = Pattern("bn_rank_forwards", _bn_rank_forwards, {}, model=Normed)
BN_EQUAL = Pattern("bn_equal", _bn_equal, {}, model=Normed)


def _buffers(model):
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _bn_reference(pattern, world_size):
    """:func:`patterns.reference`, with the running statistics as distckpt documents them: each rank starts a step
    from rank 0's and updates its own copy with its forwards; rank 0's is every rank's after the step."""
    model = build(pattern)
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad])
    grads = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        start, rank0 = _buffers(model), None
        for r in range(world_size):
            model.load_state_dict(start, strict=False)
            xs = micro_batches(pattern, step, r, world_size)
            pattern.schedule(model, pattern.loss, xs, step, r, contextlib.nullcontext, 1.0 / world_size)
            rank0 = rank0 or _buffers(model)
        model.load_state_dict(rank0, strict=False)
        grads.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return (grads, {n: p.detach().clone() for n, p in model.named_parameters()}), _buffers(model)


def _train_bn(rank, world_size, pattern, kwargs=None):
    model = build(pattern)
    distckpt.wrap(model, "full", blocks=pattern.blocks)
    pm = distckpt.parallelize(model, "ddp", **(kwargs or {}))
    try:
        result = train_parallel(pm, pattern, "ddp", rank, world_size, steps=STEPS)
    except distckpt.ConfigError as e:
        return ("refused", str(e))
    return ("ok", result, _buffers(pm.module), pm.forward_sync_buffers)


def _assert_bn_exact(out, pattern, world_size):
    (ref, ref_buffers) = _bn_reference(pattern, world_size)
    assert all(o[0] == "ok" for o in out), out
    assert_matches([o[1] for o in out], ref)
    for o in out:
        assert o[3] is False  # no broadcast at every forward
        for n, b in ref_buffers.items():
            torch.testing.assert_close(o[2][n], b, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"buffer {n}: {m}")


@pytest.mark.parametrize("pattern", [BN_FORWARDS, BN_EQUAL], ids=["unequal-forwards", "equal-forwards"])
def test_batchnorm_ddp_exact(dist_pool, pattern):
    """A model with BatchNorm, rank 1 running an extra forward on odd steps: before, a hang (DDP's buffer broadcast at
    rank 1's extra forward had no partner). Now exact, and the running statistics are rank 0's on every rank."""
    _assert_bn_exact(dist_pool.run(_train_bn, pattern, timeout=CALL_S), pattern, 2)


def test_batchnorm_ddp_exact_on_4_ranks(pool4):
    _assert_bn_exact(pool4.run(_train_bn, BN_FORWARDS, timeout=CALL_S), BN_FORWARDS, 4)


def test_ddp_buffer_sync_each_forward_asked_for_is_refused(dist_pool):
    """forward_sync_buffers=True, as the user asked: DDP broadcasts at every forward, so the handshake guards it."""
    out = dist_pool.run(_train_bn, BN_FORWARDS, {"forward_sync_buffers": True}, timeout=CALL_S)
    assert all(o[0] == "refused" for o in out), out
    assert out[0][1] == out[1][1]
    assert "rank 1 began forward 2 of step 1" in out[0][1] and "drop forward_sync_buffers" in out[0][1], out[0][1]


def test_ddp_buffer_sync_turned_off_by_the_user_is_kept_off(dist_pool):
    """forward_sync_buffers=False, as the user asked: exact gradients, and each rank keeps its own statistics."""
    out = dist_pool.run(_train_bn, BN_FORWARDS, {"forward_sync_buffers": False}, timeout=CALL_S)
    (ref, _) = _bn_reference(BN_FORWARDS, 2)
    assert all(o[0] == "ok" for o in out), out
    assert_matches([o[1] for o in out], ref)
    name = "blocks.0.norm.running_mean"
    assert not torch.equal(out[0][2][name], out[1][2][name])
