"""strategy=hsdp end to end: two torchrun agents as two "nodes" on 127.0.0.1 (2 ranks each, a 2x2 mesh),
against a single-process run; a worker killed with SIGKILL on the second node, both agents restarting
their workers, which resume from the latest checkpoint, bitwise equal to the uninterrupted run."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from launchkit import TINY, assert_params_equal, compose, final_params, kill_group, popen, torchrun_cmd

from distckpt._spawn import host_store
from launch.run import train

pytestmark = pytest.mark.launch

# 8 steps, checkpoints every 3: the kill after step 5 resumes from step_3. (Was 16 steps, every 4, kill at
# 10: the same path with twice the steps on 4 workers sharing 2 cores.)
STEPS = [*TINY, "trainer.max_steps=8", "trainer.save_every=3", "trainer.keep_last=0"]
HSDP = [*STEPS, "strategy=hsdp", "trainer.guard_every=1"]  # shard_size: LOCAL_WORLD_SIZE = 2 per node


def _two_nodes(overrides: list[str], run: Path, restarts: int = 0) -> list[tuple[str, str]]:
    """Two agents (--nnodes=2, 2 ranks each) meeting at a c10d rendezvous; their (stdout, stderr)."""
    # The rendezvous' store, served by this process: the agents find its port bound and join it as clients
    # (torch's c10d backend). A free_port() could be bound by another process (an xdist worker) meanwhile.
    store = host_store()
    port = store.port
    agent = [
        "--nnodes=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=hsdp{port}",
        f"--max-restarts={restarts}",
    ]
    agents = [popen(torchrun_cmd(overrides, run, nproc=2, extra=agent)) for _ in range(2)]
    try:
        outs = [a.communicate(timeout=300) for a in agents]
    except subprocess.TimeoutExpired:
        outs = [("", "timed out")] * 2
    finally:
        for a in agents:
            kill_group(a)
    assert [a.returncode for a in agents] == [0, 0], "\n".join(f"{o[-2000:]}\n{e[-3000:]}" for o, e in outs)
    return outs


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run = tmp_path_factory.mktemp("hsdp") / "straight"
    outs = _two_nodes(HSDP, run)
    return run, "".join(out for out, _ in outs), sum("distckpt run summary" in out for out, _ in outs)


def test_hsdp_two_nodes_match_single_process(uninterrupted, tmp_path):
    run, out, summaries = uninterrupted
    assert summaries == 1  # rank 0 only, on one of the two agents
    assert "strategy=hsdp x4 (mesh 2 replicate x 2 shard)" in out and "0 -> 8 of 8" in out
    assert "grad sync: 8 steps compared across 4 ranks, all in sync" in out
    train(compose([*STEPS, "strategy=none", "ac=none"]), run_dir=tmp_path / "none")
    assert_params_equal(final_params(run, STEPS), final_params(tmp_path / "none", STEPS), exact=False)


@pytest.mark.slow
def test_hsdp_kill_9_on_one_node_and_resume_bitwise(uninterrupted, tmp_path):
    """Slow only (4 workers started twice on 2 cores): the default run takes its two paths in
    test_torchrun.py::test_kill_9_and_torchrun_restart_resume_bitwise (a worker SIGKILLed, torchrun restarting
    the workers, which resume from the latest checkpoint bitwise) and test_hsdp_two_nodes_match_single_process
    above (two agents at a c10d rendezvous, strategy=hsdp on a 2x2 mesh)."""
    run = tmp_path / "killed"
    # Rank 3 (the second node's second worker) SIGKILLs itself after step 5, first attempt only.
    kill = "trainer.callbacks=[{_target_:tests.faults.KillAt,step:5,rank:3}]"  # tests/faults.py
    out = "".join(o for o, _ in _two_nodes([*HSDP, kill], run, restarts=1))
    assert "resumed from step_3" in out
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps.count(4) == 2 and steps[-1] == 8  # steps 4-5 ran twice: before the kill and after
    assert_params_equal(final_params(run, STEPS), final_params(uninterrupted[0], STEPS), exact=True)
