"""Every config in conf/ composes and validates; bad overrides exit 2 with a short message naming the fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from launchkit import ROOT, compose, env
from omegaconf import OmegaConf

from distckpt.errors import ConfigError
from launch.check import check_overrides
from launch.config import validate

CONF = ROOT / "conf"
GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir())
# Options that need another group to make sense (validate() refuses them alone, on purpose).
CUSTOM = [
    "model=custom",
    "model._target_=examples.custom.TwoTaskNet",
    "data=custom",
    "data._target_=examples.custom.make_dataset",
]
NEEDS = {
    ("data", "digits"): ["model=mlp"],
    ("precision", "bf16_sharded"): ["strategy=fsdp2"],
    ("model", "custom"): CUSTOM,
    ("data", "custom"): CUSTOM,
    ("data", "tokens"): [f"data.path={ROOT / 'pyproject.toml'}"],
    ("data", "hf"): [f"data.path={ROOT / 'tests' / 'durations.txt'}", f"data.tokenizer={ROOT}"],
}  # any existing file: composition and validation only
if not torch.cuda.is_available():  # budget:auto is the free CUDA memory
    NEEDS[("ac", "budget")] = ["ac.size=1GiB"]


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
    needed = {o.split("=")[0] for o in NEEDS.get((group, option), [])}
    for key, value in written.items():  # every value in the file reached the composed config, typed
        if not (isinstance(value, str) and "${" in value) and f"{group}.{key}" not in needed:
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


@pytest.mark.parametrize(
    "override,instead",
    [
        ("ckpt=full", "ac=full"),
        ("ckpt.policy=every:2", "ac.policy=every:2"),
        ("+ckpt.reentrant=true", "ac.reentrant=true"),
    ],
)
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
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "train.py"), "--check", "ckpt=full"],
        cwd=ROOT,
        env=dict(env(), DISTCKPT_NPROC="2"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "config error: the config group `ckpt` is now called `ac`: write ac=full instead of ckpt=full."
    ]


@pytest.mark.parametrize(
    "override,expect",
    [
        ("trainer.max_steps=abc", "trainer.max_steps"),
        ("trainer.max_stepz=3", "max_stepz"),
        ("strategy=bogus", "strategy/bogus"),
        ("model=hf model.config_name=???", "model.config_name"),
        ("data=digits", "model=mlp"),
        ("data.batch_size=7", "data.batch_size"),
        ("strategy.name=fsdp3", "strategy.name"),
        ("precision.dtype=fp16 precision.grad_scaler=false", "grad scaler"),
        ("trainer.on_nonfinite=ignore", "trainer.on_nonfinite"),
    ],
)
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
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "train.py"), "trainer.max_steps=abc", f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
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


# --- every field has a typed range, checked before anything is written (issue 11) ---------------------
@pytest.mark.parametrize(
    "override,expect",
    [
        ("data.batch_size=0", "data.batch_size=0 is out of range: it must be an integer >= 1"),
        ("model.seq_len=0", "model.seq_len=0 is out of range: it must be an integer >= 2"),
        ("optim.min_lr_ratio=-1", "optim.min_lr_ratio=-1.0 is out of range: it must be a number in [0, 1]"),
        ("optim.lr=-1", "optim.lr=-1.0 is out of range: it must be a number > 0"),
        ("optim.lr=nan", "optim.lr=nan is out of range: it must be a number > 0"),
        ("model.dropout=1.5", "model.dropout=1.5 is out of range: it must be a number in [0, 1)"),
        ("model.vocab_size=0", "model.vocab_size=0 is out of range: it must be an integer >= 1"),
        ("model.n_layer=0", "model.n_layer=0 is out of range: it must be an integer >= 1"),
        ("model=mlp model.hidden=0", "model.hidden=0 is out of range: it must be an integer >= 1"),
        ("optim.weight_decay=-0.1", "optim.weight_decay=-0.1 is out of range: it must be a number >= 0"),
        ("optim.betas=[0.9,1.0]", "optim.betas=[0.9,1.0] is out of range: each value must be a number in [0, 1)"),
        ("optim.betas=[0.9]", "optim.betas=[0.9] needs 2 values"),
        ("trainer.keep_last=-1", "trainer.keep_last=-1 is out of range: it must be an integer >= 0"),
        ("ac=every_n ac.n=0", "ac.n=0 is out of range: it must be an integer >= 1"),
        ("ac.policy=every:0", "ac.policy=every:0: every:N needs an integer N >= 1, got 0."),
        ("ac.policy=fraction:1.5", "ac.policy=fraction:1.5: fraction:F needs 0 <= F <= 1, got 1.5."),
        ("ac.policy=sometimes", "ac.policy=sometimes: unknown checkpoint policy 'sometimes'."),
        ("ac=budget ac.size=lots", "ac.size=lots: 'lots' is not a size"),
        (
            "ac=budget ac.size=1GiB ac.offload_flops_per_byte=0",
            "ac.offload_flops_per_byte=0.0 is out of range: it must be a number > 0",
        ),
        ("ac.blocks=[nomatch.*]", "ac.blocks=[nomatch.*]: blocks=['nomatch.*'] matches no module of MultiTaskGPT."),
        ("ac.policy=selective ac.reentrant=true", "needs reentrant=False"),
        (
            "ac=budget ac.size=auto trainer.device=cpu",
            "budget:auto uses the free CUDA memory, and this run has no CUDA",
        ),
    ],
)
def test_out_of_range_value_is_refused_by_check(override, expect, capsys, monkeypatch):
    """`--check` (what `make train` runs before torchrun) refuses it: exit 2, at most two lines naming the
    override and what it allows."""
    argv = ["--check", *override.split()]
    monkeypatch.setenv("DISTCKPT_NPROC", "2")
    monkeypatch.setattr(sys, "argv", ["train.py", *argv])
    with pytest.raises(SystemExit) as e:
        check_overrides(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert 1 <= len(err) <= 2 and err[0].startswith("config error: "), err
    assert expect in err[0], err


def test_every_numeric_field_has_a_range():
    """A new int/float field in a schema (nested ones too) needs its row in RANGES, or validate() would
    let any value through."""
    import dataclasses
    import typing

    from launch.config import RANGES
    from launch.schema import SCHEMAS

    def numeric_fields(prefix: str, schema: type):
        for name, hint in typing.get_type_hints(schema).items():
            base = typing.get_args(hint) or (hint,)  # Optional[int], list[float] -> their element types
            if dataclasses.is_dataclass(hint):
                if f"{prefix}.{name}" != "trainer.fault":  # test hooks, not a user setting (leaving the config)
                    yield from numeric_fields(f"{prefix}.{name}", hint)
            elif any(t in (int, float) for t in base):
                yield f"{prefix}.{name}"

    missing = [key for group, _, schema in SCHEMAS for key in numeric_fields(group, schema) if key not in RANGES]
    assert not missing, missing


def test_ranges_accept_their_bounds():
    from launch.config import DROPOUT, PROBABILITY, SIZE, Range

    assert 1 in SIZE and 0 not in SIZE and 1.5 in SIZE
    assert 0.0 in DROPOUT and 0.99 in DROPOUT and 1.0 not in DROPOUT
    assert 0.0 in PROBABILITY and 1.0 in PROBABILITY and -1e-9 not in PROBABILITY
    assert 1e-12 in Range(0, lo_open=True) and 0.0 not in Range(0, lo_open=True)
    assert float("inf") not in Range(0) and float("nan") not in Range() and True not in Range()
    assert (str(SIZE), str(DROPOUT), str(PROBABILITY), str(Range(0, lo_open=True))) == (
        ">= 1",
        "in [0, 1)",
        "in [0, 1]",
        "> 0",
    )


# One fresh Python + torch + Hydra each; all three exit through the same check before @hydra.main (their
# messages are checked in process above). The default run keeps ac.blocks=[nomatch.*], which needs the
# model built before the refusal; the other two are slow only.
@pytest.mark.parametrize(
    "override",
    [
        pytest.param("data.batch_size=0", marks=pytest.mark.slow),
        "ac.blocks=[nomatch.*]",
        pytest.param("ac.policy=every:0", marks=pytest.mark.slow),
    ],
)
def test_refused_run_writes_no_run_dir(override, tmp_path):
    """A plain run (not --check) with a bad value: exit 2 in one or two lines, and no run dir, no config.yaml."""
    run_dir = tmp_path / "outputs" / "run"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "train.py"), override, f"hydra.run.dir={run_dir}"],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip().splitlines()
    assert 1 <= len(err) <= 2 and err[0].startswith("config error: ") and "Traceback" not in proc.stderr, err
    assert not (tmp_path / "outputs").exists()


def test_train_validates_the_model_before_writing(tmp_path):
    """train(cfg) itself (the tests' and torchrun's path) refuses the config before making the run dir."""
    from distckpt.errors import ConfigError
    from launch.run import train

    with pytest.raises(ConfigError, match=r"ac.blocks=\[nomatch\.\*\]"):
        train(compose(["ac.blocks=[nomatch.*]", "strategy=none"]), run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_missing_transformers_names_the_hf_extra():
    """model=hf without transformers installed (hidden in a fresh process): exit 2 naming the extra."""
    code = (
        "import runpy, sys; sys.modules['transformers'] = None; "
        f"sys.argv = ['train.py', '--check', 'model=hf']; runpy.run_path({str(ROOT / 'launch' / 'train.py')!r}, "
        "run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "config error: model=hf needs the transformers package, which is not installed: pip install -e '.[hf]' "
        "(from the checkout)."
    ]


def test_every_extra_named_exists_in_pyproject():
    tomllib = pytest.importorskip("tomllib")

    from launch.config import EXTRAS

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for _, _, module, extra in EXTRAS:  # the extra installs the package that provides the module
        dist = {"sklearn": "scikit-learn"}.get(module, module)
        assert any(req.startswith(dist) for req in extras.get(extra, [])), (module, extra)


@pytest.mark.parametrize(
    "overrides,world,local,expect",
    [
        (["strategy=hsdp"], 4, None, None),  # shard_size null: the job's ranks (one node) before torchrun
        (["strategy=hsdp"], 4, "2", None),  # LOCAL_WORLD_SIZE under torchrun: 2 nodes x 2
        (["strategy=hsdp", "strategy.shard_size=2"], 4, None, None),
        (["strategy=hsdp", "strategy.shard_size=3"], 4, None, "does not divide the world size 4"),
        (["strategy=hsdp"], 4, "3", "does not divide the world size 4"),
        (["strategy=hsdp", "strategy.shard_size=0"], 4, None, "is out of range: it must be an integer >= 1"),
        (["strategy=fsdp2", "strategy.shard_size=2"], 4, None, "is for strategy='hsdp'"),
    ],
)
def test_hsdp_shard_size_is_validated(overrides, world, local, expect, monkeypatch):
    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    cfg = compose([*overrides, "data.batch_size=8"])
    if expect is None:
        validate(cfg, world_size=world)
        return
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=world)
    assert expect in str(e.value) and "strategy.shard_size" in str(e.value), str(e.value)
