"""Checkpointed stages under torch.distributed.pipelining (GPipe, 1F1B) on 2 gloo ranks, one stage each: non-reentrant
blocks train as the single-process model without checkpointing does; reentrant blocks raise a ConfigError naming
``reentrant=False`` on the stage whose schedule asks for input gradients with ``.grad()`` (before: torch's raw
"incompatible with .grad()" error), and the other stage ends with the connection closed, not a hang (issue 31)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from harness import RankError
from patterns import Block

import distckpt

pytestmark = pytest.mark.dist

MICRO = 4


def _full():
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(4)])


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)


def _loss(out, y):
    return (out - y).pow(2).mean()


def _stage_step(rank, world_size, schedule, reentrant):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    stage_mod = nn.Sequential(*list(_full())[2 * rank : 2 * rank + 2])
    distckpt.wrap(stage_mod, "full", blocks=[Block], reentrant=reentrant)
    stage = PipelineStage(stage_mod, rank, world_size, torch.device("cpu"))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    x, y = _data()
    run = kind(stage, n_microbatches=MICRO, loss_fn=_loss)
    run.step(x) if rank == 0 else run.step(target=y)
    return {
        f"{2 * rank + int(n.split('.')[0])}.{n.split('.', 1)[1]}": p.grad.tolist()
        for n, p in stage_mod.named_parameters()
    }


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_nonreentrant_stages_exact(dist_pool, schedule):
    out = dist_pool.run(_stage_step, schedule, False, timeout=60)
    ref = _full()
    x, y = _data()
    for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO)):
        # The schedule backwards each micro-batch's loss and divides the sum by their number (scale_grads=True).
        (_loss(ref(xm), ym) / MICRO).backward()
    got = {**out[0], **out[1]}
    assert got.keys() == {n for n, _ in ref.named_parameters()}
    for n, p in ref.named_parameters():
        torch.testing.assert_close(torch.tensor(got[n]), p.grad, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_reentrant_stages_refused(dist_pool, schedule):
    with pytest.raises(RankError) as e:
        dist_pool.run(_stage_step, schedule, True, timeout=60)
    # Stage 1 computes its input gradients with .grad() while inferring shapes: refused there. Stage 0 waits for those
    # gradients' shapes and ends as soon as stage 1's process group closes (the pool's answer, not its timeout).
    kind, msg, _ = e.value.errors[1]
    assert kind == "ConfigError" and "reentrant-checkpointed Block" in msg and "reentrant=False" in msg, msg
