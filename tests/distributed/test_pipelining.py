"""Pipelining (``torch.distributed.pipelining``) with checkpointed stage blocks on 4 gloo ranks: alone (4 stages, or
8 for the schedules that hold two per rank) and with FSDP2 over the "dp" dimension of a 2x2 ("pp", "dp") mesh, each
stage's module checkpointed by ``distckpt.wrap`` and sharded by ``distckpt.parallelize`` (torchtitan's order, one
stage at a time). Every run is compared with the single-process model without checkpointing on the same global batch.

The stage modules keep their blocks in an ``nn.ModuleDict`` keyed by block number (torchtitan's layout: a stage's
FQNs are the whole model's), and ``wrap`` finds them itself. One pool of 4 ranks for the module."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
from harness import DistPool, RankError
from patterns import (
    PATTERNS,
    TASKS,
    MultiTask,
    _mse,
    assert_matches,
    build,
    full_grads,
    full_params,
    make_optimizer,
    micro_batches,
    reference,
)

import distckpt

pytestmark = pytest.mark.dist

WORLD, STEPS = 4, 3
SINGLE = ("ScheduleGPipe", "Schedule1F1B")  # one stage per rank; the others hold two


@pytest.fixture(scope="module")
def pool4():
    pool = DistPool(world_size=WORLD, timeout=180)
    yield pool
    pool.close()


class Stage(nn.Module):
    """Blocks ``idx`` of a MultiTask (the first stage also its embedding, the last its heads, one output each)."""

    def __init__(self, model: MultiTask, idx: list[int], first: bool, last: bool):
        super().__init__()
        self.embed = model.embed if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in idx})
        self.heads = model.heads if last else None

    def forward(self, h: torch.Tensor):
        if self.embed is not None:
            h = self.embed(h)
        for layer in self.blocks.values():
            h = layer(h)
        return h if self.heads is None else tuple(self.heads[t](h) for t in TASKS)


def _loss(name, dp_rank):
    def loss_fn(out, x):  # the pattern's loss on the last stage's head outputs (pipelining passes the target)
        if name == "by_rank":  # dp rank 0 uses head a, dp rank 1 head b; c is used by no rank
            return _mse(out[dp_rank % 2], x)
        return sum(_mse(o, x) for o in out)

    return loss_fn


def _pattern(name, stages):
    return dataclasses.replace(PATTERNS[name], model_kwargs={"n_blocks": 2 * stages})


def _no_weight_pass():
    return lambda: None  # a dw_builder's runner: the stage's input pass ran a full backward already


def _run(rank, world_size, name, schedule_name, pp, fsdp, dw_builder=None):
    import torch.distributed.pipelining as pipelining
    from torch.distributed.device_mesh import init_device_mesh

    dp = world_size // pp
    mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    stages = pp * (1 if schedule_name in SINGLE else 2)
    torch.manual_seed(0)
    model = MultiTask(n_blocks=2 * stages)  # the same initial values as the reference's
    if schedule_name == "ScheduleZBVZeroBubble":
        mine = [pp_rank, 2 * pp - 1 - pp_rank]  # the V: rank 0 holds the first and the last stage
    else:
        mine = [pp_rank] if stages == pp else [pp_rank, pp_rank + pp]
    modules, pipe_stages = [], []
    for s in mine:
        # The order, per stage: pipeline split, (tensor parallel), checkpointing, (compile), FSDP2 per block and the
        # stage's root last.
        module = Stage(model, [2 * s, 2 * s + 1], s == 0, s == stages - 1)
        distckpt.wrap(module, "full")
        if fsdp:
            module = distckpt.parallelize(module, "fsdp2", device_mesh=mesh["dp"])
        modules.append(module)
        pipe_stages.append(
            pipelining.PipelineStage(
                module, s, stages, torch.device("cpu"), group=mesh["pp"].get_group(), dw_builder=dw_builder
            )
        )
    schedule_cls = getattr(pipelining, schedule_name)
    schedule = schedule_cls(pipe_stages[0] if stages == pp else pipe_stages, 2 * pp, loss_fn=_loss(name, dp_rank))
    opt = make_optimizer([p for m in modules for p in m.parameters()])
    grads = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        x = micro_batches(_pattern(name, stages), step, dp_rank, dp)[0]
        schedule.step(*([x] if 0 in mine else []), **({"target": x} if stages - 1 in mine else {}))
        opt.step()  # FSDP2's reduction ran in the schedule, outside autograd: the join's window closes here
        grads.append({n: _full(p.grad) for m in modules for n, p in m.named_parameters()})
    return grads, {n: _full(p) for m in modules for n, p in m.named_parameters()}


def _full(t):
    if t is None:
        return None
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _several(rank, world_size, runs):
    return [_run(rank, world_size, *run) for run in runs]


def _check(results, runs):
    for k, (name, schedule_name, pp, fsdp) in enumerate(runs):
        stages = pp * (1 if schedule_name in SINGLE else 2)
        ref_grads, ref_params = reference(_pattern(name, stages), world_size=WORLD // pp, steps=STEPS)
        seen = set()
        for rank, per_rank in enumerate(results):
            grads, params = per_rank[k]
            where = f"{name} {schedule_name} pp={pp} fsdp2={fsdp} rank {rank}"
            for step, got in enumerate(grads):
                for n, g in got.items():
                    seen.add(n)
                    r = ref_grads[step][n]
                    assert (g is None) == (r is None), (
                        f"{where} step {step} {n}: grad None {g is None}, ref {r is None}"
                    )
                    if r is not None:
                        torch.testing.assert_close(
                            g, r, rtol=1e-5, atol=1e-6, msg=lambda m, n=n, w=where: f"{w} {n}: {m}"
                        )
            for n, p in params.items():
                torch.testing.assert_close(
                    p, ref_params[n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n, w=where: f"{w} {n}: {m}"
                )
        assert seen == set(ref_grads[0]), (name, schedule_name, set(ref_grads[0]) - seen)


# Alone: every schedule family, zero-bubble included (its split backward computes weight gradients by
# torch.autograd.grad). With FSDP2 on the 2x2 mesh: all heads, and heads by dp rank (head b unused on dp rank 0, c on
# every rank: its gradient stays None, as without parallelism), one stage per rank and two (interleaved).
RUNS = [
    ("all_heads", "ScheduleGPipe", 4, False),
    ("by_rank", "Schedule1F1B", 4, False),
    ("all_heads", "ScheduleInterleaved1F1B", 4, False),
    ("all_heads", "ScheduleInterleavedZeroBubble", 4, False),
    ("all_heads", "ScheduleZBVZeroBubble", 4, False),
    ("all_heads", "ScheduleGPipe", 2, True),
    ("by_rank", "ScheduleGPipe", 2, True),
    ("by_rank", "Schedule1F1B", 2, True),
    ("all_heads", "ScheduleInterleaved1F1B", 2, True),
    ("by_rank", "ScheduleInterleaved1F1B", 2, True),
]


def test_pipelining_matches_single_process(pool4):
    _check(pool4.run(_several, RUNS, timeout=600), RUNS)


# --- Zero-bubble with FSDP2 where the stages have a dw_builder: exact, not refused --------------------------------


def test_zero_bubble_with_fsdp2_and_a_dw_builder_matches_single_process(pool4):
    """Not refused where the stages have a ``dw_builder``: their input pass is then a full backward (FSDP2 sees a
    plain one) and the weight pass the user's (here nothing), so the step is exact."""
    run = ("all_heads", "ScheduleZBVZeroBubble", 2, True)
    results = pool4.run(_run, *run, dw_builder=_no_weight_pass, timeout=300)
    _check([[r] for r in results], [run])


# --- FSDP2's own no-sync, as the schedules use it, in a plain loop ---------------------------------------------


def _native_no_sync(rank, world_size, name):
    """``pattern``'s micro-batches with FSDP2's own ``set_requires_gradient_sync(False)`` around all but the last
    (instead of distckpt.accumulate): the windows of the unsynced backwards wait for the optimizer's step, and the
    last, synced backward closes them first (closing again at the step would reset every gradient)."""
    import contextlib

    pattern = PATTERNS[name]
    model = build(pattern)
    distckpt.wrap(model, "full", blocks=pattern.blocks)
    pm = distckpt.parallelize(model, "fsdp2")

    @contextlib.contextmanager
    def no_sync():
        pm.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            pm.set_requires_gradient_sync(True)

    opt = make_optimizer([p for p in pm.parameters() if p.requires_grad])
    grads = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        pattern.schedule(pm, pattern.loss, micro_batches(pattern, step, rank, world_size), step, rank, no_sync, 1.0)
        opt.step()
        grads.append(full_grads(pm, "fsdp2"))
    return grads, full_params(pm, "fsdp2")


def test_fsdp2_native_no_sync_matches_single_process(pool4):
    assert_matches(
        pool4.run(_native_no_sync, "accumulate", timeout=300), reference(PATTERNS["accumulate"], WORLD, STEPS)
    )


# --- Zero-bubble schedules with FSDP2: refused on every rank at the first step ----------------------------------
# Last in the module: after a call that raised, the pool's ranks join a fresh group, and a later FSDP2 run on a mesh
# of the same shape can get a DTensor gradient on the previous group's mesh from torch's DTensor caches (keyed by mesh
# equality, which ignores the groups): "Could not resolve the process group registered under the name 7" (measured,
# torch 2.13, the dw_builder run after a refusal). No later call of this pool runs, so none can meet it.

ZERO_BUBBLE = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble")


@pytest.mark.parametrize("schedule_name", ZERO_BUBBLE)
def test_zero_bubble_with_fsdp2_refused_on_every_rank(pool4, schedule_name):
    """Their split backward takes the weight gradients with respect to FSDP2's sharded parameters, which the forward
    never used: without the refusal, a raw ``Trying to backward through the graph a second time`` on the ranks that
    reach a weight pass first and "Connection closed by peer" on the others (measured). With it, every rank raises the
    ConfigError at the end of the first step's shape inference, before any micro-batch."""
    with pytest.raises(RankError) as err:
        pool4.run(_run, "all_heads", schedule_name, 2, True, timeout=180)
    errors = err.value.errors
    assert sorted(errors) == list(range(WORLD)) and err.value.kinds() == {"ConfigError"}, err.value
    for _, message, _ in errors.values():
        assert message.startswith(f"{schedule_name} does not work with FSDP2 stages"), message
        for fix in ("ScheduleGPipe, Schedule1F1B or ScheduleInterleaved1F1B with FSDP2", "without data parallelism"):
            assert fix in message, message
