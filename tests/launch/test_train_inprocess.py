"""``train(cfg)`` in this process (strategy=none): outputs, resume, non-finite steps, loggers, other models."""

from __future__ import annotations

import json
import shutil
import time
import warnings

import pytest
import torch
from launchkit import TINY, assert_params_equal, compose, final_params

from distckpt.errors import ConfigError
from distckpt.train import NonFiniteLossError
from launch.run import train

NONE = [*TINY, "strategy=none"]


def _train(tmp_path, name, overrides):
    return train(compose(overrides), run_dir=tmp_path / name)


def test_run_writes_config_metrics_and_atomic_checkpoints(tmp_path):
    res = _train(tmp_path, "a", [*NONE, "trainer.max_steps=9", "trainer.eval_every=3"])
    run = tmp_path / "a"
    assert res.step == 9 and res.start_step == 0 and res.resumed_from is None
    assert res.checkpointed == ["blocks.0", "blocks.1"]
    assert (run / "config.yaml").read_text().count("max_steps: 9") == 1
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 10))
    for r in records:
        assert {"step", "loss", "lm", "cls", "samples_per_s", "peak_mem_mib", "lr", "grad_norm"} <= r.keys()
        assert r["loss"] == pytest.approx(r["lm"] + r["cls"], rel=1e-5)
    assert "eval_loss" in records[2] and "eval_loss" not in records[0]
    # trainer=debug keeps every checkpoint; only complete step_N folders, no temp folders left.
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_3", "step_6", "step_9"]
    assert all((run / "checkpoints" / s / ".metadata").is_file() for s in ("step_3", "step_6", "step_9"))


def test_training_reduces_the_loss(tmp_path):
    res = _train(tmp_path, "a", [*NONE, "trainer.max_steps=60", "trainer.save_every=0", "trainer.log_every=5"])
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert res.losses["loss"] < 0.8 * records[0]["loss"]


def test_resume_from_latest_complete_checkpoint_is_bitwise_equal(tmp_path):
    over = [*NONE, "trainer.max_steps=8", "trainer.save_every=3", "model.dropout=0.1"]
    _train(tmp_path, "ref", over)
    ref = final_params(tmp_path / "ref", over)
    _train(tmp_path, "cut", over)
    ckpts = tmp_path / "cut" / "checkpoints"
    shutil.rmtree(ckpts / "step_8")
    shutil.rmtree(ckpts / "step_6")
    shutil.copytree(ckpts / "step_3", ckpts / ".tmp_step_6")  # a save that crashed: must be ignored
    (ckpts / ".tmp_step_6" / ".metadata").unlink()
    res = _train(tmp_path, "cut", over)
    assert res.start_step == 3 and res.resumed_from.endswith("step_3") and res.step == 8
    assert not (ckpts / ".tmp_step_6").exists()
    assert_params_equal(final_params(tmp_path / "cut", over), ref, exact=True)


def _nan_at(steps) -> str:
    """The override installing the tests' NaN-gradient fault (tests/faults.py) at ``steps`` (None: every step)."""
    arg = "" if steps is None else f",steps:[{','.join(map(str, steps))}]"
    return f"trainer.callbacks=[{{_target_:tests.faults.NanGrads{arg}}}]"


def _skips_said(caplog) -> list[str]:
    """The steps the loop told the user it skipped (the ``distckpt`` logger: rank 0's log)."""
    return [m for m in caplog.messages if m.endswith("non-finite loss or gradient norm on some rank; step skipped")]


def test_nonfinite_loss_is_skipped_on_request(tmp_path, capsys, caplog):
    over = [*NONE, _nan_at([2, 4]), "trainer.on_nonfinite=skip"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PYTHONWARNINGS=ignore: each skip is still said
        res = _train(tmp_path, "a", over)
    assert res.skipped_steps == [2, 4] and res.step == 6
    assert [m.split(":")[0] for m in _skips_said(caplog)] == ["step 2", "step 4"]
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [False, True, False, True, False, False]
    params = final_params(tmp_path / "a", over)
    assert all(torch.isfinite(p).all() for p in params.values())
    summary = capsys.readouterr().out
    assert "2 of 6 steps skipped (non-finite loss or gradient norm; no update): 2, 4" in summary


def test_nonfinite_loss_stops_without_writing_a_checkpoint(tmp_path):
    over = [*NONE, _nan_at([4]), "trainer.on_nonfinite=stop", "trainer.save_every=2"]
    with pytest.raises(NonFiniteLossError, match="step 4") as e:
        _train(tmp_path, "a", over)
    assert len(str(e.value).splitlines()) == 2 and "trainer.on_nonfinite=skip" in str(e.value)
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == ["step_2"]


def test_skip_stops_after_max_consecutive_skips(tmp_path, caplog):
    over = [*NONE, _nan_at([2, 3, 4, 5]), "trainer.max_consecutive_skips=3", "trainer.save_every=1"]
    with pytest.raises(NonFiniteLossError) as e:
        _train(tmp_path, "a", over)
    assert [m.split(":")[0] for m in _skips_said(caplog)] == ["step 2", "step 3"]  # the third one stops
    assert str(e.value).startswith("3 steps in a row (2-4) had a non-finite loss")
    assert "trainer.max_consecutive_skips" in str(e.value)
    assert sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == ["step_1", "step_2", "step_3"]


def test_a_run_where_every_step_is_skipped_fails(tmp_path, capsys, caplog):
    # 6 steps, fewer than the default limit of 10 in a row: the end of the run must still not look like success.
    with pytest.raises(NonFiniteLossError, match="every step"):
        _train(tmp_path, "a", [*NONE, _nan_at(None), "trainer.save_every=0"])
    assert len(_skips_said(caplog)) == 6
    assert "distckpt run summary" not in capsys.readouterr().out
    assert not (tmp_path / "a" / "checkpoints").exists()


def test_wandb_offline_without_key_or_network(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    t0 = time.perf_counter()
    _train(tmp_path, "a", [*NONE, "logger=wandb", "trainer.max_steps=3", "trainer.save_every=0"])
    assert time.perf_counter() - t0 < 60  # never waits for a login prompt or a network timeout
    run = tmp_path / "a"
    run_id = (run / "wandb_id.txt").read_text()
    assert list((run / "wandb").glob(f"offline-run-*-{run_id}")), list((run / "wandb").iterdir())


def test_tensorboard_events(tmp_path):
    pytest.importorskip("tensorboard")
    _train(tmp_path, "a", [*NONE, "logger=tensorboard", "trainer.max_steps=3", "trainer.save_every=0"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "a" / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == [1, 2, 3]


def test_digits_mlp_two_tasks(tmp_path):
    pytest.importorskip("sklearn")
    res = _train(
        tmp_path,
        "a",
        [
            "strategy=none",
            "model=mlp",
            "data=digits",
            "trainer=debug",
            "trainer.max_steps=40",
            "trainer.save_every=0",
            "trainer.eval_every=40",
        ],
    )
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert set(res.losses) == {"loss", "a", "b"}
    assert res.losses["a"] < 0.6 * records[0]["a"]


def test_hf_causal_lm_from_a_config_name(tmp_path):
    pytest.importorskip("transformers")
    res = _train(
        tmp_path,
        "a",
        [
            *NONE,
            "model=hf",
            "model.config_name=gpt2",
            "model.d_model=32",
            "trainer.max_steps=2",
            "trainer.save_every=0",
        ],
    )
    assert set(res.losses) == {"loss", "lm", "cls"} and res.step == 2
    assert res.checkpointed == ["lm.transformer.h.0", "lm.transformer.h.1"]  # found by distckpt.wrap


def test_guards_run_when_enabled(tmp_path):
    res = _train(
        tmp_path, "a", [*NONE, "trainer.guard_every=2", "trainer.verify_recompute=true", "trainer.save_every=0"]
    )
    assert res.guard_checks == 3  # steps 1, 3, 5 of 6
    assert (
        res.guard == "grad sync: 3 steps checked (one process: no-gradient check only); recompute check: ok "
        "(recompute equals forward)"
    )


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_tracks_fp32(tmp_path, precision):
    ref = _train(tmp_path, "fp32", [*NONE, "trainer.save_every=0"])
    res = _train(tmp_path, precision, [*NONE, f"precision={precision}", "trainer.save_every=0"])
    assert res.skipped_steps == [] and res.step == 6
    assert res.losses["loss"] == pytest.approx(ref.losses["loss"], rel=2e-2)
    assert res.losses["loss"] != ref.losses["loss"]  # autocast really ran in lower precision


@pytest.mark.parametrize(
    "target,expect",
    [
        ("tests.faults.Nope", "trainer.callbacks: cannot make tests.faults.Nope: "),
        (
            "collections.OrderedDict",
            "trainer.callbacks: collections.OrderedDict made a OrderedDict, not a "
            "distckpt.train.Callback; subclass it.",
        ),
    ],
)
def test_bad_callback_is_a_config_error(tmp_path, target, expect):
    with pytest.raises(ConfigError) as e:
        _train(tmp_path, "a", [*NONE, f"trainer.callbacks=[{{_target_:{target}}}]"])
    assert str(e.value).startswith(expect) and len(str(e.value).splitlines()) == 1
    assert not (tmp_path / "a").exists()  # refused before the run dir is made
