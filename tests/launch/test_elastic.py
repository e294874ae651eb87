"""Elastic resume under torchrun: a run on 4 gloo ranks killed mid-epoch resumes on 2 ranks, is killed again
mid-epoch and resumes on 4, with the same global batch. Every global step trains on exactly the samples, in
the order, of an uninterrupted single process: none repeated, none skipped.

In the default tier (issue 24 names it in `make test`; three launches, ~30 s on a quiet 2-core machine). Its paths
are also taken, faster, by tests/unit/test_data.py::test_map_style_position_resumes_exactly_on_another_world_size
(the loader's saved position resumed on another number of ranks, sample by sample against a single process) and
tests/launch/test_torchrun.py::test_nonfinite_stop_under_torchrun_is_two_lines_and_exit_3 (a checkpoint of one
process resumed on 2 ranks under torchrun)."""

from __future__ import annotations

from pathlib import Path

import pytest
from launchkit import assert_params_equal, compose, final_params, kill_group, popen, torchrun, torchrun_cmd
from sample_log import global_batches

from launch.run import train

pytestmark = [pytest.mark.launch]

STEPS = 20
# 96 numbered samples, global batch 8: 12 steps an epoch, so the kills after steps 7 and 17 are mid-epoch
# (the resumes start from step_6 in epoch 0 and step_15 in epoch 1) and the run crosses one epoch boundary.
JOB = [
    "model=custom",
    "model._target_=tests.sample_log.IdNet",
    "data=custom",
    "data._target_=tests.sample_log.make_ids",
    "data.batch_size=8",
    "ac=none",
    "trainer=debug",
    f"trainer.max_steps={STEPS}",
    "trainer.save_every=3",
    "trainer.eval_every=0",
    "trainer.guard_every=0",
]


def _callbacks(ids: Path, kill: int | None) -> str:
    entries = [f"{{_target_:tests.sample_log.LogIds,path:'{ids}'}}"]
    if kill is not None:  # tests/faults.py: rank 1 SIGKILLs itself after step `kill`
        entries.append(f"{{_target_:tests.faults.KillAt,step:{kill},rank:1}}")
    return f"trainer.callbacks=[{','.join(entries)}]"


def _killed(run: Path, ids: Path, nproc: int, kill: int) -> str:
    """A launch on ``nproc`` ranks that dies after step ``kill`` (no restarts); its output."""
    agent = popen(torchrun_cmd([*JOB, "strategy=ddp", _callbacks(ids, kill)], run, nproc=nproc))
    try:
        out, err = agent.communicate(timeout=180)
    finally:
        kill_group(agent)
    assert agent.returncode != 0, "the launch was meant to be killed"
    return out + err


@pytest.fixture(scope="module")
def elastic(tmp_path_factory):
    """4 ranks killed after step 7, resumed on 2 killed after 17, resumed on 4 to the end; and the reference."""
    root = tmp_path_factory.mktemp("elastic")
    run, ids = root / "run", root / "ids"
    _killed(run, ids, nproc=4, kill=7)
    _killed(run, ids, nproc=2, kill=17)
    last = torchrun([*JOB, "strategy=ddp", _callbacks(ids, None)], run, nproc=4).stdout
    ref_dir = root / "ref"
    train(compose([*JOB, "strategy=none", _callbacks(root / "ref_ids", None)]), run_dir=ref_dir)
    return run, global_batches(ids), global_batches(root / "ref_ids"), last, ref_dir


def test_each_global_step_after_a_resume_on_another_world_size_has_the_uninterrupted_samples(elastic):
    _, got, ref, last, _ = elastic
    assert sorted(ref) == list(range(1, STEPS + 1)) and all(len(ids) == 8 for ids in ref.values())
    assert "resumed from step_15" in last and f"15 -> {STEPS} of {STEPS}" in last
    assert sorted(got) == sorted(ref)
    for step in ref:  # steps 1-6 on 4 ranks, 7-15 on 2 (7 ran twice: the resumed run's counts), 16-20 on 4
        assert got[step] == ref[step], f"step {step}: {got[step]} != {ref[step]}"


def test_no_sample_is_repeated_or_skipped_across_the_two_resumes(elastic):
    _, got, _, _, _ = elastic
    epoch0 = sum((got[s] for s in range(1, 13)), [])
    assert sorted(epoch0) == list(range(96))  # every sample once in epoch 0, across 4 -> 2 ranks
    epoch1 = sum((got[s] for s in range(13, STEPS + 1)), [])
    assert len(set(epoch1)) == len(epoch1)  # epoch 1 so far (2 -> 4 ranks at step 15): no sample twice


def test_the_elastic_run_ends_with_the_single_process_parameters(elastic):
    run, _, _, _, ref_dir = elastic
    assert_params_equal(final_params(run, JOB), final_params(ref_dir, JOB), exact=False)
