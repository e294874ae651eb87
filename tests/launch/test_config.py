"""Every config in conf/ composes and validates; bad overrides exit 2 with a short message naming the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from launchkit import ROOT, compose, env
from omegaconf import OmegaConf

from launch.check import check_overrides
from launch.config import validate

CONF = ROOT / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())
# Options that need another group to make sense (validate() refuses them alone, on purpose).
CUSTOM = ["model=custom", "model._target_=examples.custom.TwoTaskNet", "data=custom",
          "data._target_=examples.custom.make_dataset"]
NEEDS = {("data", "digits"): ["model=mlp"], ("precision", "bf16_sharded"): ["strategy=fsdp2"],
         ("model", "custom"): CUSTOM, ("data", "custom"): CUSTOM,
         ("data", "tokens"): [f"data.path={ROOT / 'pyproject.toml'}"]}  # any existing file: composition only


def test_groups_are_the_documented_ones():
    assert GROUPS == ["ac", "data", "logger", "model", "optim", "precision", "strategy", "trainer"]


@pytest.mark.parametrize("group,option", [(g, f.stem) for g in GROUPS for f in sorted((CONF / g).glob("*.yaml"))])
def test_every_config_file_composes(group, option):
    cfg = compose([f"{group}={option}", *NEEDS.get((group, option), [])])
    validate(cfg, world_size=2 if cfg.strategy.name != "none" else 1)
    resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    written = yaml.safe_load((CONF / group / f"{option}.yaml").read_text())
    written.pop("defaults", None)  # model=custom, data=custom: no schema (any keys)
    assert written, f"conf/{group}/{option}.yaml sets nothing"
    for key, value in written.items():  # every value in the file reached the composed config, typed
        if not (isinstance(value, str) and ("${" in value or value == "???")):  # ???: NEEDS sets it
            assert resolved[group][key] == value, (key, resolved[group][key], value)


def test_default_run_dir_is_the_same_for_every_rank_of_a_launch(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "1f3a9c2e-aaaa-bbbb-cccc-0123456789ab")
    from launch.check import compose as compose_all

    cfg = compose_all([])
    assert cfg.hydra.run.dir == "outputs/gpt-ddp/1f3a9c2e"


def test_ac_group_builds_policy_specs():
    assert compose(["ac=every_n", "ac.n=3"]).ac.policy == "every:3"
    assert compose(["ac=budget", "ac.size=20GiB"]).ac.policy == "budget:20GiB"
    assert compose(["ac=selective"]).ac.policy == "selective"


@pytest.mark.parametrize("override,instead", [("ckpt=full", "ac=full"), ("ckpt.policy=every:2", "ac.policy=every:2"),
                                              ("+ckpt.reentrant=true", "ac.reentrant=true")])
def test_old_group_name_ckpt_is_refused(override, instead, capsys, monkeypatch):
    """The group was renamed `ckpt` -> `ac`: the old name fails before torchrun with one line naming `ac`."""
    monkeypatch.setattr(sys, "argv", ["train.py", "--check", override])
    with pytest.raises(SystemExit) as e:
        check_overrides(["--check", override])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"config error: the config group `ckpt` is now called `ac`: write {instead} instead of {override}."]


def test_old_group_name_fails_make_train_check_step(tmp_path):
    """What `make train ARGS=ckpt=full` runs before torchrun: `launch/train.py --check`, exit 2."""
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), "--check", "ckpt=full"], cwd=ROOT,
                          env=dict(env(), DISTCKPT_NPROC="2"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["config error: the config group `ckpt` is now called `ac`: "
                                                "write ac=full instead of ckpt=full."]


@pytest.mark.parametrize("override,expect", [
    ("trainer.max_steps=abc", "trainer.max_steps"),
    ("trainer.max_stepz=3", "max_stepz"),
    ("strategy=bogus", "strategy/bogus"),
    ("model=hf model.config_name=???", "model.config_name"),
    ("data=digits", "model=mlp"),
    ("data.batch_size=7", "data.batch_size"),
    ("strategy.name=fsdp3", "strategy.name"),
    ("precision.dtype=fp16 precision.grad_scaler=false", "grad scaler"),
    ("trainer.on_nonfinite=ignore", "trainer.on_nonfinite"),
])
def test_bad_override_exits_2_with_a_short_message(override, expect, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(sys, "argv", ["train.py", *override.split()])
    with pytest.raises(SystemExit) as e:
        check_overrides(override.split())
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert 1 <= len(err) <= 2, err
    assert err[0].startswith("config error:") and expect in "\n".join(err)


def test_bad_override_from_the_command_line_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), "trainer.max_steps=abc",
                           f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[0].startswith("config error: Error merging override trainer.max_steps")
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 2
    assert not run_dir.exists()


def test_torchrun_world_size_is_checked(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(sys, "argv", ["train.py", "strategy=none"])
    with pytest.raises(SystemExit) as e:
        check_overrides(["strategy=none"])
    assert e.value.code == 2 and "strategy=ddp" in capsys.readouterr().err


def test_check_flag_accepts_the_default_job(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "--check"])
    with pytest.raises(SystemExit) as e:
        check_overrides(["--check"])
    assert e.value.code == 0
    assert not Path("outputs/never").exists()
