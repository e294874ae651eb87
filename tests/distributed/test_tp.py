"""Tensor parallel + checkpointing + FSDP2 on 4 gloo ranks, a 2x2 ("dp", "tp") mesh: the user applies torch's
``parallelize_module`` (blocks' fc1 column-wise, fc2 row-wise, task heads row-wise) over ``mesh["tp"]``, then
``distckpt.wrap``, then ``distckpt.parallelize(model, "fsdp2", device_mesh=mesh)``. Each run is compared with the
single-process model without checkpointing on the same global batch (the two tp ranks of a dp rank see the same
shard); the join gives an unused DTensor parameter a DTensor zero (torch 2.13 raised ``Expected DTensor`` in FSDP2's
post-backward with a plain one); GradSyncGuard compares the tp ranks that hold the same part; what is refused.

One pool of 4 ranks for the whole module (this machine has 2 cores): each test sends it one job."""

from __future__ import annotations

import pytest
import torch
from harness import DistPool
from patterns import PATTERNS, assert_matches, build, micro_batches, reference_grad_norm, reference_of, train_parallel

import distckpt
from distckpt.parallel.state import sync_state

pytestmark = pytest.mark.dist

STEPS = 3
WORLD, DP = 4, 2


@pytest.fixture(scope="module")
def pool4():
    pool = DistPool(world_size=WORLD, timeout=180)
    yield pool
    pool.close()


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (DP, WORLD // DP), mesh_dim_names=("dp", "tp"))


def _tp_model(pattern, mesh, policy="full"):
    """The pattern's model, tensor-parallel over mesh["tp"] (task heads too), then checkpointed."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = build(pattern)
    plan = {}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.fc1"] = ColwiseParallel()
        plan[f"blocks.{i}.fc2"] = RowwiseParallel()
    for t in model.heads:  # each head's input features split over tp, its output all-reduced
        plan[f"heads.{t}"] = RowwiseParallel(input_layouts=Replicate())
    parallelize_module(model, mesh["tp"], plan)
    distckpt.wrap(model, policy, blocks=pattern.blocks)
    return model


def _train(rank, world_size, name, how, policy):
    mesh = _mesh()
    pattern = PATTERNS[name]
    model = _tp_model(pattern, mesh, policy)
    pm = distckpt.parallelize(model, "fsdp2", device_mesh=mesh if how == "2d" else mesh["dp"])
    # The tp ranks of one dp rank train on the same shard: the pattern sees the dp rank and size.
    return train_parallel(pm, pattern, "fsdp2", mesh["dp"].get_local_rank(), DP, STEPS)


def _several(rank, world_size, runs):
    out = [_train(rank, world_size, *run) for run in runs]
    mesh = _mesh()
    pm = distckpt.parallelize(_tp_model(PATTERNS["all_heads"], mesh), "fsdp2", device_mesh=mesh)
    w = pm.blocks[0].fc1.weight
    layout = sync_state(pm).layout
    return out, (w.device_mesh.mesh_dim_names, tuple(w.to_local().shape)), (layout.mesh_dims, layout.describe())


# All heads; two forwards per step; heads by rank (head b unused on dp rank 0, c never: the DTensor zero); heads
# sampled by step and rank under selective checkpointing; micro-batches interleaved inside accumulate; mesh["dp"].
RUNS = [
    ("all_heads", "2d", "full"),
    ("two_forwards", "2d", "full"),
    ("by_rank", "2d", "full"),
    ("sampled", "2d", "selective"),
    ("interleaved_accumulate", "2d", "full"),
    ("by_rank", "dp", "full"),
]


def test_patterns_match_single_process(pool4):
    results = pool4.run(_several, RUNS, timeout=600)
    for k, (name, how, policy) in enumerate(RUNS):
        try:
            assert_matches([r[0][k] for r in results], reference_of(name, world_size=DP, steps=STEPS))
        except AssertionError as e:
            raise AssertionError(f"{name} over {how} with {policy}: {e}") from None
    # Really TP + FSDP2: fc1 (16 x 8) split over both dimensions of the 2-D mesh; the layout says so.
    assert {r[1] for r in results} == {(("dp", "tp"), (4, 8))}
    assert {r[2] for r in results} == {((("dp", 2), ("tp", 2)), "fsdp2 over 2 ranks x tp 2 (mesh 2 dp x 2 tp)")}


# --- refused ---------------------------------------------------------------------------------------------------


def _refusal(rank, world_size, what):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = _mesh()
    pattern = PATTERNS["all_heads"]
    plain = build(pattern)
    distckpt.wrap(plain, "full", blocks=pattern.blocks)
    cases = {
        "ddp": lambda: distckpt.parallelize(_tp_model(pattern, mesh), "ddp", device_mesh=mesh),
        "no_mesh": lambda: distckpt.parallelize(_tp_model(pattern, mesh), "fsdp2"),
        "not_tp": lambda: distckpt.parallelize(plain, "fsdp2", device_mesh=mesh),
        "world_mesh": lambda: distckpt.parallelize(
            _tp_model(pattern, mesh), "fsdp2", device_mesh=init_device_mesh("cpu", (WORLD,))
        ),
        "layout_tp": lambda: distckpt.parallelize(
            _tp_model(pattern, mesh), distckpt.Layout.of("fsdp2", world_size=WORLD), device_mesh=mesh["dp"]
        ),
    }
    try:
        cases[what]()
    except distckpt.ConfigError as e:
        return str(e)
    return None


def test_refusals(pool4):
    expect = {
        "ddp": "runs with strategy='fsdp2' only",
        "no_mesh": "parallelize needs its data-parallel ranks",
        "not_tp": "no parameter of the model is a DTensor",
        "world_mesh": "is not the data-parallel dimension",
        "layout_tp": "the Layout says fsdp2 over 4 ranks, but parallelize runs fsdp2 over 2 ranks x tp 2",
    }
    for what, text in expect.items():
        msgs = pool4.run(_refusal, what, timeout=120)
        assert all(m is not None and text in m for m in msgs), (what, msgs)


# --- GradSyncGuard on the 2x2 mesh ---------------------------------------------------------------------------


def _guard(rank, world_size, inject):
    """One step of all_heads; the guard's report, or its GradDesyncError message when ``inject`` makes rank 1's
    (dp 0, tp 1) gradient of a parameter differ from rank 0's, which holds the same part of it."""
    mesh = _mesh()
    pattern = PATTERNS["all_heads"]
    pm = distckpt.parallelize(_tp_model(pattern, mesh), "fsdp2", device_mesh=mesh)
    guard = distckpt.GradSyncGuard(pm, params_every=1)
    dp = mesh["dp"].get_local_rank()
    pattern.loss(pm, micro_batches(pattern, 0, dp, DP)[0], 0, dp).backward()
    if rank == 1 and inject:
        # embed: FSDP2-sharded over dp, the same on both tp ranks; fc2.bias: row-wise, replicated over tp.
        param = pm.embed.weight if inject == "embed" else pm.blocks[1].fc2.bias
        param.grad.to_local().view(-1)[0] += 1e-3
    try:
        report = guard.check()
    except distckpt.GradDesyncError as e:
        return str(e)
    return report.grad_norm


def test_guard_compares_the_tp_ranks_holding_the_same_part(pool4):
    ref_norm = reference_grad_norm("all_heads", DP)
    # Each distinct part counted once: the tp ranks' copies of a replicated part are not added twice.
    assert pool4.run(_guard, None, timeout=120) == [pytest.approx(ref_norm, rel=1e-5)] * WORLD
    for inject, name in (("embed", "embed.weight"), ("bias", "blocks.1.fc2.bias")):
        msgs = pool4.run(_guard, inject, timeout=120)
        for m in msgs:
            assert isinstance(m, str) and f"{name} (gradient)" in m and "ranks [1] differ from rank 0" in m, (
                inject,
                msgs,
            )


# --- the memory plan of a tensor-parallel block ------------------------------------------------------------------


def _measured_peaks(rank, world_size):
    """MemTracker's peak of a steady-state AdamW step of the launcher's gpt, tensor-parallel over mesh["tp"] (its
    plan: distckpt.parallel.tp) and FSDP2 over mesh["dp"], without and with checkpointing; and the budget profile's
    parameter bytes of the tensor-parallel model (its local shards)."""
    from plan_cases import _make_gpt, _steady_peak

    from distckpt.parallel.tp import apply_tp
    from distckpt.select.blocks import find_blocks
    from distckpt.select.profile import profile_model

    mesh, peaks = _mesh(), []
    for policy in ("none", "full"):
        torch.manual_seed(0)
        model, loss_fn, batch_fn = _make_gpt(2)
        batch = batch_fn(0, 0, 1)
        apply_tp(model, mesh["tp"], find_blocks(model, None))
        if policy == "none":
            local_bytes = profile_model(model, find_blocks(model, None), (batch,), modes=()).param_bytes
        else:
            distckpt.wrap(model, policy)
        peaks.append(_steady_peak(distckpt.parallelize(model, "fsdp2", device_mesh=mesh), loss_fn, batch))
    return peaks, local_bytes


def test_plan_counts_a_tensor_parallel_block_by_its_shards(pool4):
    from plan_cases import gpt_factory

    from distckpt.cli.plan import plan_at_scale

    results = pool4.run(_measured_peaks, timeout=300)
    measured = [max(r[0][k] for r in results) for k in range(2)]
    # distckpt plan traces one tp rank's shapes (fake tensors, one process); FSDP2 shards over the 2 dp ranks.
    tp = plan_at_scale(gpt_factory(2), strategy="fsdp2", world_size=WORLD, tp=2)
    no_tp = plan_at_scale(gpt_factory(2), strategy="fsdp2", world_size=DP)
    for k, policy in enumerate(("none", "full")):
        pred = tp.policy(policy).peak_bytes
        assert measured[k] <= pred < 1.05 * measured[k], (policy, pred, measured[k])
        assert no_tp.policy(policy).peak_bytes > 1.2 * measured[k]  # the plan without tp: far over
    # The budget's own profile of the tensor-parallel model counts the local shards, as the plan's trace does.
    assert {r[1] for r in results} == {tp.profile.param_bytes}
