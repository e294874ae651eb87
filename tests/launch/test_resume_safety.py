"""Resume never lies (in process, strategy=none): a checkpoint of another model is refused with a short
message, the config's hyperparameters win over the checkpoint's, and a damaged latest checkpoint is
skipped for the newest intact one, which is said in rank 0's log even with every warning ignored."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import faults
import pytest
from launchkit import ROOT, TINY, assert_checkpoints_equal, assert_params_equal, compose, env, final_params

from distckpt.errors import ConfigError, ResumeError
from launch.run import train

NONE = [*TINY, "strategy=none"]  # 6 steps, checkpoints step_3 and step_6


def _run(run: Path, extra: list[str]):
    return train(compose([*NONE, *extra]), run_dir=run)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A finished 6-step run (checkpoints step_3, step_6), copied fresh for each test."""
    run = tmp_path_factory.mktemp("saved") / "run"
    _run(run, [])
    return run


@pytest.fixture
def run(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.parametrize(
    "change,expect",
    [
        ("model.n_layer=3", "missing from the checkpoint: 64 (16 model, 48 optimizer), e.g. model.blocks.2.fc.bias, "),
        (
            "model.n_layer=1 ac.blocks=[blocks.*]",
            "in the checkpoint but not in this run: 64 (16 model, 48 optimizer), e.g. model.blocks.1.fc.bias, ",
        ),
        (
            "model.d_model=48",
            "shape changed: 114 (38 model, 76 optimizer), e.g. model.blocks.0.fc.bias [128] in the "
            "checkpoint, [192] now",
        ),
        (
            "optim=sgd",
            "missing from the checkpoint: 39 (0 model, 39 optimizer), e.g. optim.blocks.0.fc.bias.momentum_buffer",
        ),
    ],
)
def test_resume_of_another_model_or_optimizer_is_refused(run, change, expect):
    before = (run / "config.yaml").read_text()
    with pytest.raises(ResumeError) as e:
        _run(run, [*change.split(), "trainer.max_steps=9"])
    msg = str(e.value)
    assert isinstance(e.value, ConfigError)  # launch/train.py: exit 2, one message on rank 0
    assert msg.startswith(f"cannot resume from {run / 'checkpoints' / 'step_6'}: ")
    assert expect in msg and len(msg.splitlines()) <= 25
    assert "trainer.resume=false" in msg and "hydra.run.dir" in msg
    assert (run / "config.yaml").read_text() == before  # the refused config is not recorded
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_3", "step_6"]


def test_shape_change_names_the_tensor_and_both_shapes(run):
    with pytest.raises(ResumeError, match=r"model\.cls_head\.weight \[4, 32\] in the checkpoint, \[5, 32\] now"):
        _run(run, ["model.n_classes=5", "trainer.max_steps=9"])


def test_resume_false_starts_the_changed_model_over(run):
    res = _run(run, ["model.n_layer=3", "trainer.resume=false"])
    assert res.resumed_from is None and res.start_step == 0 and res.step == 6
    assert "n_layer: 3" in (run / "config.yaml").read_text()


def test_resumed_checkpoint_equals_the_uninterrupted_one_entry_by_entry(run):
    # Resumed from step_3, the run writes step_6 again: every saved entry (model, optimizer, scheduler with
    # its _step_count, step, data position, RNG) must equal the uninterrupted run's step_6.
    shutil.copytree(run / "checkpoints" / "step_6", run / "uninterrupted_step_6")
    shutil.rmtree(run / "checkpoints" / "step_6")
    res = _run(run, [])
    assert res.start_step == 3 and res.step == 6
    assert_checkpoints_equal(run / "checkpoints" / "step_6", run / "uninterrupted_step_6")


def _lrs(run: Path) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out.setdefault(r["step"], []).append(r["lr"])
    return out


def test_config_lr_and_schedule_win_over_the_checkpoint(run):
    shutil.rmtree(run / "checkpoints" / "step_6")
    res = _run(run, ["optim.lr=1e-5", "optim.warmup_steps=2", "trainer.max_steps=8"])
    assert res.start_step == 3 and res.step == 8
    from launch.build import WarmupDecay

    schedule = WarmupDecay("cosine", 2, 8, 0.1)  # the new config's schedule, not the checkpoint's
    lrs = _lrs(run)
    for step in range(4, 9):
        assert lrs[step][-1] == pytest.approx(1e-5 * schedule(step), rel=1e-9), step
    assert lrs[3] == [pytest.approx(3e-3 * WarmupDecay("cosine", 10, 6, 0.1)(3))]  # the first run's


def _damage(path: Path, how: str) -> None:
    if how == "truncated shard":
        faults.truncate(path / "__0_0.distcp")
    elif how == "truncated metadata":
        faults.truncate(path / ".metadata")
    else:
        faults.flip_bytes(path / "__0_0.distcp", offset=1024, n=4096)


@pytest.mark.parametrize("how", ["truncated shard", "truncated metadata", "flipped bytes"])
def test_damaged_latest_checkpoint_is_skipped_for_the_newest_intact(run, tmp_path, how, caplog):
    _damage(run / "checkpoints" / "step_6", how)
    ref = tmp_path / "ref"  # the same run resumed from an intact step_3
    shutil.copytree(run, ref)
    shutil.rmtree(ref / "checkpoints" / "step_6")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PYTHONWARNINGS=ignore: the skip is still said (the distckpt logger)
        res = _run(run, ["trainer.max_steps=9"])
    damaged = [m for m in caplog.messages if m.startswith("skipped damaged")]  # (tmp_path's name has "damaged")
    assert len(damaged) == 1, damaged
    assert damaged[0].startswith("skipped damaged checkpoints: step_6 (")
    assert damaged[0].endswith(f"resuming from {run / 'checkpoints' / 'step_3'}")
    assert res.start_step == 3 and res.step == 9
    _run(ref, ["trainer.max_steps=9"])
    assert_params_equal(final_params(run, NONE, step=9), final_params(ref, NONE, step=9), exact=True)


def test_no_intact_checkpoint_is_a_short_error_naming_the_folder(run):
    _damage(run / "checkpoints" / "step_6", "flipped bytes")
    _damage(run / "checkpoints" / "step_3", "truncated shard")
    with pytest.raises(ResumeError) as e:
        _run(run, ["trainer.max_steps=9"])
    msg = str(e.value)
    assert msg.startswith(
        f"no intact checkpoint in {run / 'checkpoints'}: step_6 (__0_0.distcp does not match "
        "its checksum (corrupted bytes)), step_3 (__0_0.distcp has "
    )
    assert "trainer.resume=false" in msg and len(msg.splitlines()) == 1


def test_checkpoint_without_manifest_loads_with_a_message(run, caplog):
    (run / "checkpoints" / "step_6" / "manifest.json").unlink()  # as written by an older distckpt
    res = _run(run, ["trainer.max_steps=9"])
    assert [m for m in caplog.messages if "no manifest" in m] == [
        f"resuming from {run / 'checkpoints' / 'step_6'} (it has no manifest: written by an older distckpt, unchecked)"
    ]
    assert res.start_step == 6


def test_damaged_checkpoint_is_said_under_the_launcher_with_warnings_ignored(run):
    """``python launch/train.py`` end to end (Hydra's job logging on rank 0) with ``PYTHONWARNINGS=ignore``, common in
    training scripts: before, the skipped checkpoint went by without a word."""
    _damage(run / "checkpoints" / "step_6", "flipped bytes")
    cmd = [sys.executable, "launch/train.py", *NONE, "trainer.max_steps=7", f"hydra.run.dir={run}"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**env(), "PYTHONWARNINGS": "ignore"}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stdout.splitlines() if "skipped damaged" in line]
    assert len(said) == 1 and said[0].startswith("skipped damaged checkpoints: step_6 ("), proc.stdout[-3000:]
    assert said[0].endswith(f"resuming from {run / 'checkpoints' / 'step_3'}")


def test_every_checkpoint_has_a_manifest_of_all_its_files(run):
    for step in ("step_3", "step_6"):
        folder = run / "checkpoints" / step
        manifest = json.loads((folder / "manifest.json").read_text())
        assert manifest["checksum"] == "crc32"
        assert set(manifest["files"]) == {p.name for p in folder.iterdir()} - {"manifest.json"}
        assert {".metadata", "__0_0.distcp"} <= set(manifest["files"])
        for name, entry in manifest["files"].items():
            assert entry["size"] == (folder / name).stat().st_size
