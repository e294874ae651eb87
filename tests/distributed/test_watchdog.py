"""The hang watchdog (distckpt.parallel.watchdog) on 2 spawned gloo ranks: a deadlock nothing else catches (rank 1
waits in a collective of another group inside its forward, rank 0 in the step's own) ends both processes within
seconds of ``hang_timeout``, with exit code EXIT_HANG and a diagnosis naming each rank's phase, step and wait; a rank
busy outside the model for longer than ``hang_timeout`` while the other waits for it ends nothing, and the run trains
as the single-process reference does. Own processes, not the test pool: the watchdog ends the process it runs in."""

from __future__ import annotations

import logging
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

import distckpt
from distckpt._spawn import host_store, init_rank
from distckpt.parallel.watchdog import EXIT_HANG

pytestmark = pytest.mark.dist

JOIN_S = 240  # spawning and importing on a loaded 2-core machine takes most of it; the watchdog's part is seconds


class Trap(nn.Module):
    """A linear layer whose second forward on rank 1 joins a collective of another group that rank 0 never joins."""

    def __init__(self, group):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.group = group
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if dist.get_rank() == 1 and self.calls == 2:
            dist.all_reduce(torch.zeros(1), group=self.group)  # a deadlock: rank 0 is in the step's own collective
        return self.lin(x)


def _model(group=None):
    """Two linear layers; with ``group``, the first is a :class:`Trap`."""
    torch.manual_seed(0)
    return nn.Sequential(Trap(group) if group is not None else nn.Linear(4, 4), nn.Linear(4, 1))


def _deadlock(rank, world, port, log, strategy):
    init_rank(rank, world, port, threads=1)
    logging.basicConfig(filename=log, level=logging.INFO)
    group = dist.new_group([0, 1], backend="gloo")
    pm = distckpt.parallelize(_model(group), strategy, hang_timeout=1.5)
    for _ in range(3):
        pm(torch.randn(2, 4)).sum().backward()


def _busy_peer(rank, world, port, log, out):
    """Rank 0 works outside the model (Python, as a checkpoint save does) for 1.25 hang_timeout after step 0, while
    rank 1 waits for it in step 1's handshake (FSDP2): rank 1's alarm stands, rank 0 answers that it is working."""
    init_rank(rank, world, port, threads=1)
    logging.basicConfig(filename=log, level=logging.INFO)
    pm = distckpt.parallelize(_model(), "fsdp2", hang_timeout=4.0)
    opt = torch.optim.SGD(pm.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        pm(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and step == 0:
            end = time.monotonic() + 5.0
            while time.monotonic() < end:
                sum(i * i for i in range(1000))
    weights = [p.full_tensor().tolist() for p in pm.parameters()]  # lists: a tensor's memory dies with the process
    dist.destroy_process_group()
    out.put((rank, weights))


def _after_an_error(rank, world, port, log):
    """A ConfigError raised inside a backward (autograd.grad through reentrant blocks) skips the hook that ends the
    phase; then both ranks sit still outside the model for twice hang_timeout. Not a hang: the phase ended with the
    frame it lived in."""
    init_rank(rank, world, port, threads=1)
    logging.basicConfig(filename=log, level=logging.INFO)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 1))
    distckpt.wrap(model, "full", blocks=["1"], reentrant=True)
    pm = distckpt.parallelize(model, "ddp", hang_timeout=1.5)
    x = torch.randn(2, 4, requires_grad=True)
    with pytest.raises(distckpt.ConfigError, match="reentrant=False"):  # (a failure here exits the rank with 1)
        torch.autograd.grad(pm(x).sum(), x)
    time.sleep(4.0)
    dist.barrier()
    dist.destroy_process_group()


def _spawn(target, tmp_path, *args):
    """Start both ranks; (exit codes, log text per rank)."""
    store = host_store()
    ctx = mp.get_context("spawn")
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = [ctx.Process(target=target, args=(r, 2, store.port, str(logs[r]), *args)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(JOIN_S)
    for p in procs:
        if p.is_alive():  # a hang the watchdog did not end: fail, after cleaning up
            p.kill()
            p.join()
    return [p.exitcode for p in procs], [log.read_text() if log.exists() else "" for log in logs]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_deadlock_ends_every_rank_with_a_diagnosis(tmp_path, strategy):
    codes, logs = _spawn(_deadlock, tmp_path, strategy)
    assert codes == [EXIT_HANG, EXIT_HANG], (codes, logs)
    diagnosis = logs[0]
    assert "hang: a rank waited more than 1.5 s in one place" in diagnosis, diagnosis
    assert "rank 0: in backward 1 of step 1" in diagnosis, diagnosis
    assert "rank 1: in forward 1 of step 1" in diagnosis and "(all_reduce)" in diagnosis, diagnosis
    assert "called from" in diagnosis and "test_watchdog.py" in diagnosis, diagnosis  # the user's line
    assert "rank 1" in logs[1]


def test_busy_peer_outside_the_model_is_not_a_hang(tmp_path):
    out = mp.get_context("spawn").Queue()
    codes, logs = _spawn(_busy_peer, tmp_path, out)
    assert codes == [0, 0], (codes, logs)
    assert "hang" not in logs[0] + logs[1], logs
    weights = dict(out.get(timeout=10) for _ in range(2))
    assert weights[0] == weights[1]
    # The single-process reference: the same three SGD steps on the two ranks' batches, averaged.
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        for r in range(2):
            x = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * step + r))
            (model(x).pow(2).mean() / 2).backward()
        opt.step()
        opt.zero_grad()
    for got, want in zip(weights[0], model.parameters()):
        torch.testing.assert_close(torch.tensor(got), want.detach(), rtol=1e-5, atol=1e-6)


def test_hang_timeout_checked():
    with pytest.raises(distckpt.ConfigError, match="hang_timeout=-1.*None"):
        distckpt.parallelize(nn.Linear(2, 2), "ddp", hang_timeout=-1)


def test_phase_left_by_an_exception_is_not_watched(tmp_path):
    codes, logs = _spawn(_after_an_error, tmp_path)
    assert codes == [0, 0], (codes, logs)
    assert "hang" not in logs[0] + logs[1], logs
