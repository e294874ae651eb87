"""`model=custom` / `data=custom`: a user's model and data set through `_target_`, and the errors of bad targets."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from launchkit import (
    ROOT,
    assert_params_equal,
    compose,
    env,
    example_commands,
    final_params,
    launcher_overrides,
    train_on_ranks,
)

from distckpt.errors import ConfigError
from launch.check import check_overrides
from launch.run import train

pytestmark = pytest.mark.launch

CUSTOM = [
    "model=custom",
    "model._target_=examples.custom.TwoTaskNet",
    "+model.width=32",
    "data=custom",
    "data._target_=examples.custom.make_dataset",
    "+data.n=256",
    "data.batch_size=16",
    "+data.eval.split=eval",
    "trainer=debug",
    "trainer.save_every=0",
    "trainer.log_every=1",
]
WEIGHTED = "+trainer.task_weights={cls: 1.0, reg: 0.5}"


def _metrics(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_custom_model_and_data_learn_with_weighted_task_losses(tmp_path):
    over = [*CUSTOM, WEIGHTED, "strategy=none", "trainer.max_steps=48", "trainer.eval_every=16"]
    res = train(compose(over), run_dir=tmp_path / "run")
    records = _metrics(tmp_path / "run")
    assert res.checkpointed == ["blocks.0", "blocks.1"]
    for r in records:  # each task's loss logged; the loss is their weighted sum
        assert r["loss"] == pytest.approx(r["cls"] + 0.5 * r["reg"], rel=1e-5)
    assert records[-1]["reg"] < 0.5 * records[0]["reg"] and records[-1]["cls"] < 0.9 * records[0]["cls"]
    assert "eval_loss" in records[15] and res.eval_loss is not None  # +data.eval.split=eval: an eval split


def test_custom_example_on_2_ranks_matches_a_single_process(dist_pool, tmp_path):
    # examples/custom.py's docstring command as written (CUSTOM's model and data, WEIGHTED), fewer steps:
    # also the examples test of that command (tests/launch/test_examples.py). Its overrides run on the pool's
    # 2 ranks as torchrun's workers run them (launchkit.train_on_ranks; torchrun itself: test_torchrun.py).
    (cmd,) = example_commands("custom.py")
    over = [
        *launcher_overrides(cmd),
        "trainer=debug",
        "trainer.save_every=0",
        "trainer.log_every=1",
        "trainer.max_steps=24",
        "trainer.eval_every=0",
    ]  # 16 batches/epoch: 1.5 epochs
    dist_pool.run(train_on_ranks, [*over, "strategy=ddp"], str(tmp_path / "ddp"))
    ref = train(compose([*over, "strategy=none", "ac=none"]), run_dir=tmp_path / "ref")
    records = _metrics(tmp_path / "ddp")
    assert records[-1]["step"] == 24 and {"cls", "reg"} <= records[-1].keys()
    assert records[-1]["loss"] == pytest.approx(records[-1]["cls"] + 0.5 * records[-1]["reg"], rel=1e-5)
    assert records[-1]["loss"] == pytest.approx(ref.losses["loss"], rel=1e-4)
    assert_params_equal(final_params(tmp_path / "ddp", over), final_params(tmp_path / "ref", over), exact=False)


def _launch(args: list[str], tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "launch" / "train.py"), *args, f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


BAD_TARGETS = [
    ("model._target_=no_such_pkg.Net", "model._target_=no_such_pkg.Net cannot be imported (No module named"),
    ("model._target_=examples.custom.NoSuchNet", "model._target_=examples.custom.NoSuchNet cannot be imported"),
    (
        "+model.widht=3",
        "model._target_=examples.custom.TwoTaskNet cannot be called with the arguments "
        "['widht', 'width'] (got an unexpected keyword argument 'widht')",
    ),
    ("data._target_=examples.custom.n_samples", "data._target_=examples.custom.n_samples cannot be imported"),
    ("+data.size=3", "data._target_=examples.custom.make_dataset cannot be called with the arguments ['n', 'size']"),
]


@pytest.mark.parametrize(("override", "message"), BAD_TARGETS)
def test_check_refuses_a_bad_target_in_a_few_lines(override, message, capsys, monkeypatch):
    # In this process: check_overrides is all that `launch/train.py --check` runs (a fresh Python, torch and
    # Hydra per case cost seconds each); the command itself runs in the next test.
    for var in ("RANK", "WORLD_SIZE", "DISTCKPT_NPROC"):
        monkeypatch.delenv(var, raising=False)
    argv = ["--check", *CUSTOM, override]
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    with pytest.raises(SystemExit) as e:
        check_overrides(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err, err
    assert len(err.splitlines()) <= 25


def test_check_of_a_bad_target_from_the_command_line_writes_nothing(tmp_path):
    override, message = BAD_TARGETS[0]
    proc = _launch(["--check", *CUSTOM, override], tmp_path)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) <= 25 and not (tmp_path / "config.yaml").exists()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "model._target_=examples.custom.make_dataset ~model.width",
            "model._target_=examples.custom.make_dataset returned a Features; it must return an nn.Module",
        ),
        ("data.n=-4", "data._target_=examples.custom.make_dataset raised when called"),
    ],
)
def test_a_target_that_fails_when_called_exits_2_naming_it(override, message, tmp_path):
    proc = _launch([*CUSTOM, "strategy=none", *override.split()], tmp_path)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-3000:]
    assert len(proc.stderr.splitlines()) <= 25


def test_forward_must_return_named_scalar_losses_and_weights_name_them(tmp_path):
    identity = [*CUSTOM, "model._target_=launchkit.TensorLossNet", "~model.width", "strategy=none", "ac=none"]
    with pytest.raises(ConfigError, match="must return a dict of named scalar losses"):
        train(compose(identity), run_dir=tmp_path / "a")
    with pytest.raises(ConfigError, match=r"trainer.task_weights names \['rgr'\].*its tasks are \['cls', 'reg'\]"):
        train(compose([*CUSTOM, "strategy=none", "+trainer.task_weights={rgr: 2.0}"]), run_dir=tmp_path / "b")
