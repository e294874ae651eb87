"""End to end on 2 CPU ranks: each strategy against a single-process run (the launcher's overrides on the pool's
ranks, as torchrun's workers run them: launchkit.train_on_ranks), and under torchrun itself: kill -9 with a
torchrun restart and SIGTERM, each resumed bitwise against the uninterrupted run, the exit codes of a resume
error and a non-finite stop, and (slow) two torchrun agents as two nodes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launchkit import (
    ROOT,
    TINY,
    assert_checkpoints_equal,
    assert_params_equal,
    compose,
    final_params,
    kill_group,
    popen,
    torchrun,
    torchrun_cmd,
    train_on_ranks,
)
from torch.distributed.checkpoint import FileSystemReader

from distckpt._spawn import host_store
from launch.run import train

pytestmark = pytest.mark.launch

# Resume tests: more steps, checkpoints every 4, a shuffled data set of 40 samples (5 global batches of 8
# per epoch: 16 steps are 3 epochs and a step, enough for the kills at 10 and 14 below and their replays;
# was 30 steps, 6 epochs, which no assertion needed). (Dropout's RNG restore is tested in process, where
# the single-process reference can use it too.)
LONG_STEPS = 16
LONG = [*TINY, f"trainer.max_steps={LONG_STEPS}", "trainer.save_every=4", "trainer.keep_last=0", "data.n=40"]


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """The reference: one process, no parallelism, no checkpointing, same global batch and init."""
    run = tmp_path_factory.mktemp("ref") / "none"
    result = train(compose([*TINY, "strategy=none", "ac=none"]), run_dir=run)
    return run, result


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, dist_pool):
    """DDP on 2 ranks, never interrupted: the reference of the resume tests; rank 0's stdout."""
    run = tmp_path_factory.mktemp("long") / "ddp"
    return run, dist_pool.run(train_on_ranks, [*LONG, "strategy=ddp"], str(run))[0]


def _metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_ddp_matches_single_process(uninterrupted, tmp_path):
    run, out = uninterrupted
    assert "strategy=ddp x2" in out and f"0 -> {LONG_STEPS} of {LONG_STEPS}" in out
    ref = train(compose([*LONG, "strategy=none", "ac=none"]), run_dir=tmp_path / "none")
    last = _metrics(run)[-1]
    assert last["step"] == LONG_STEPS and last["loss"] == pytest.approx(ref.losses["loss"], rel=1e-4)
    assert_params_equal(final_params(run, LONG), final_params(tmp_path / "none", LONG), exact=False)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml", "metrics.jsonl"]


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2"])
def test_strategy_matches_single_process(strategy, single_process, dist_pool, tmp_path):
    ref_dir, ref = single_process
    run = tmp_path / strategy
    over = [*TINY, f"strategy={strategy}", "trainer.guard_every=1", "trainer.verify_recompute=true"]
    out = "".join(dist_pool.run(train_on_ranks, over, str(run)))
    assert out.count("distckpt run summary") == 1 and f"strategy={strategy} x2" in out  # rank 0 only
    assert "grad sync: 6 steps compared across 2 ranks, all in sync; recompute check: ok" in out
    assert "blocks.0, blocks.1" in out  # the summary says what was checkpointed
    last = _metrics(run)[-1]
    assert last["step"] == 6
    assert last["loss"] == pytest.approx(ref.losses["loss"], rel=1e-4)
    assert last["lm"] == pytest.approx(ref.losses["lm"], rel=1e-4)
    assert_params_equal(final_params(run, TINY), final_params(ref_dir, TINY), exact=False)
    # Only rank 0 writes the run's files, all into the one run dir.
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml", "metrics.jsonl"]


# The default run keeps (10, 1): resumed mid-epoch, replayed steps crossing an epoch boundary, read by a
# DataLoader worker per rank. (14, 0) takes the same kill/restart/resume path without a worker and without
# the crossing (the loader's own resume, 0 and 1 workers, mid-epoch and at the boundary, is tested in
# tests/unit/test_data.py; DDP resume without workers also in the SIGTERM test below): slow only.
@pytest.mark.parametrize(("kill", "workers"), [(10, 1), pytest.param(14, 0, marks=pytest.mark.slow)])
def test_kill_9_and_torchrun_restart_resume_bitwise(kill, workers, uninterrupted, tmp_path):
    run = tmp_path / "killed"
    # Rank 1 SIGKILLs itself after step `kill` (first attempt only); torchrun restarts both workers, which
    # resume from the latest complete checkpoint, 2 steps earlier. Kill at 10: step_8 is batch 3 of epoch 1
    # and the replayed steps cross into epoch 2. Kill at 14: step_12 is mid-epoch 2. With workers=1 a
    # DataLoader worker process per rank reads the data (the reference has none: it must not depend on it).
    fault = f"trainer.callbacks=[{{_target_:tests.faults.KillAt,step:{kill},rank:1}}]"  # tests/faults.py
    proc = torchrun(
        [*LONG, "strategy=ddp", fault, f"data.num_workers={workers}"], run, extra=["--standalone", "--max-restarts=1"]
    )
    assert f"resumed from step_{kill - 2}" in proc.stdout
    steps = [r["step"] for r in _metrics(run)]
    assert steps.count(kill - 1) == 2 and steps[-1] == LONG_STEPS  # two steps ran twice: before the kill and after
    assert_params_equal(final_params(run, LONG), final_params(uninterrupted[0], LONG), exact=True)
    # Not only the weights: every entry of each checkpoint written after the resume (optimizer, scheduler
    # with its _step_count, step, both ranks' data positions and RNG states) equals the uninterrupted run's.
    for step in range((kill // 4 + 1) * 4, LONG_STEPS + 1, 4):
        assert_checkpoints_equal(
            run / "checkpoints" / f"step_{step}", uninterrupted[0] / "checkpoints" / f"step_{step}"
        )


def _worker_pids(agent: subprocess.Popen) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(agent.pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_sigterm_saves_on_every_rank_at_the_same_step_then_resumes_bitwise(uninterrupted, dist_pool, tmp_path):
    run = tmp_path / "term"
    agent = popen(torchrun_cmd([*LONG, "strategy=ddp"], run))
    try:
        deadline = time.monotonic() + 90
        while not _metrics(run) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = _worker_pids(agent)
        assert len(pids) == 2 and _metrics(run), "the workers did not start"
        os.kill(pids[-1], signal.SIGTERM)  # one worker only: the other must stop at the same step
        out, err = agent.communicate(timeout=90)
    finally:
        kill_group(agent)
    assert agent.returncode == 0, err[-3000:]
    assert "stopped by signal" in out
    ckpts = sorted(int(p.name.split("_")[1]) for p in (run / "checkpoints").iterdir())
    stop = ckpts[-1]
    assert _metrics(run)[-1]["step"] == stop
    # Both ranks wrote their part of that checkpoint (each rank's RNG state is a per-rank entry).
    meta = FileSystemReader(str(run / "checkpoints" / f"step_{stop}")).read_metadata()
    assert {"train.rng.rank0.torch", "train.rng.rank1.torch"} <= meta.state_dict_metadata.keys()
    if stop == LONG_STEPS:
        pytest.skip("SIGTERM arrived only after the last step (a very slow machine); nothing to resume")
    # The same command resumes from the SIGTERM save: its workers' train(cfg), on the pool's 2 ranks (a resume
    # under torchrun, after its restart: test_kill_9_and_torchrun_restart_resume_bitwise).
    dist_pool.run(train_on_ranks, [*LONG, "strategy=ddp"], str(run))
    assert_params_equal(final_params(run, LONG), final_params(uninterrupted[0], LONG), exact=True)
    last = f"step_{LONG_STEPS}"
    assert_checkpoints_equal(run / "checkpoints" / last, uninterrupted[0] / "checkpoints" / last)


# Slow only: tests/launch/test_hsdp_nodes.py runs two agents at a c10d rendezvous as two nodes in the
# default run (2 ranks each, strategy=hsdp, against a single process, the summary printed once); this
# one is the same rendezvous with one DDP rank per agent.
@pytest.mark.slow
def test_two_torchrun_agents_as_two_nodes(single_process, tmp_path):
    ref_dir, _ = single_process
    run = tmp_path / "multinode"
    store = host_store()  # the rendezvous' store, served here (as in test_hsdp_nodes.py)
    port = store.port
    agents = [
        popen(
            torchrun_cmd(
                [*TINY, "strategy=ddp"],
                run,
                nproc=1,
                extra=["--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=twonodes"],
            )
        )
        for _ in range(2)
    ]
    try:
        outs = [a.communicate(timeout=120) for a in agents]
    finally:
        for a in agents:
            kill_group(a)
    assert [a.returncode for a in agents] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert sum("distckpt run summary" in out for out, _ in outs) == 1  # rank 0 only
    assert "strategy=ddp x2" in "".join(out for out, _ in outs)
    assert_params_equal(final_params(run, TINY), final_params(ref_dir, TINY), exact=False)


def _wrapped_torchrun(overrides: list[str], run: Path) -> subprocess.CompletedProcess:
    """What `make train` runs: torchrun through launch/torchrun.py, which exits with the workers' code."""
    agent = popen(
        [
            sys.executable,
            "-m",
            "launch.torchrun",
            "--standalone",
            "--nproc_per_node=2",
            str(ROOT / "launch" / "train.py"),
            *overrides,
            f"hydra.run.dir={run}",
        ]
    )
    try:
        out, err = agent.communicate(timeout=120)
    finally:
        kill_group(agent)
    return subprocess.CompletedProcess(agent.args, agent.returncode, out, err)


@pytest.fixture
def one_process_run(tmp_path):
    """A finished 6-step run of one process (checkpoints step_3 and step_6), to resume on 2 ranks."""
    run = tmp_path / "run"
    train(compose([*TINY, "strategy=none"]), run_dir=run)
    return run


def test_resume_error_under_torchrun_is_one_message_and_exit_2(one_process_run):
    proc = _wrapped_torchrun([*TINY, "strategy=ddp", "model.n_layer=3", "trainer.max_steps=9"], one_process_run)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr.strip().splitlines()
    assert err[0].startswith(f"resume error: cannot resume from {one_process_run / 'checkpoints' / 'step_6'}: ")
    assert len(err) <= 25 and proc.stderr.count("resume error") == 1  # rank 0 only
    assert "Traceback" not in proc.stderr + proc.stdout and "ChildFailedError" not in proc.stderr
    assert "trainer.resume=false" in err[-1]


def test_nonfinite_stop_under_torchrun_is_two_lines_and_exit_3(one_process_run):
    # Also a resume on another world size (1 -> 2 ranks): only the per-rank RNG entries differ, so it loads.
    nan = "trainer.callbacks=[{_target_:tests.faults.NanGrads,steps:[8],rank:1}]"  # tests/faults.py
    proc = _wrapped_torchrun(
        [*TINY, "strategy=ddp", "trainer.max_steps=9", "trainer.on_nonfinite=stop", nan], one_process_run
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "step_6" in proc.stdout
    assert proc.stderr.strip().splitlines() == [
        "stopped: non-finite loss or gradient norm at step 8 (on at least one rank); stopped without saving.",
        "Lower optim.lr, use precision=fp32, or set trainer.on_nonfinite=skip.",
    ]
    assert sorted(p.name for p in (one_process_run / "checkpoints").iterdir()) == ["step_3", "step_6"]


def test_make_train_runs_torchrun_through_the_exit_code_wrapper():
    target = (ROOT / "Makefile").read_text().split("\ntrain:")[1].split("\n\n")[0]
    assert "-m launch.torchrun --standalone" in target and "$(BIN)/torchrun" not in target
