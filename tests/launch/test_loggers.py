"""wandb never blocks or ends a run: a bad key, an unreachable or silent server, or an init that fails
offline too, each give one message on the ``distckpt`` logger (rank 0's log), which ``PYTHONWARNINGS=ignore``
does not hide, and the run goes on (offline, or without wandb); metrics.jsonl is always written."""

from __future__ import annotations

import importlib.util
import json
import socket
import warnings

import pytest
from launchkit import TINY, compose

from launch.loggers import WandbWriter

# Imported by the tests that use it (wandb_env), not at collection: every pytest-xdist worker collects this file.
needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="needs wandb")

KEY40 = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """wandb's own files under tmp_path; the mode comes from the test, not the environment."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    yield monkeypatch
    wandb.teardown()  # wandb's service keeps the first settings it read (key, base URL) for the process


def _writer(run_dir, caplog, **kw):
    """The writer and what it told the user (the ``distckpt`` logger), every warning ignored."""
    run_dir.mkdir(parents=True, exist_ok=True)
    caplog.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = WandbWriter(run_dir, "online", "distckpt-test", {"a": 1}, **kw)
    ours = [r.getMessage() for r in caplog.records if r.name == "distckpt" and r.getMessage().startswith("wandb:")]
    return w, ours


def _offline_runs(run_dir):
    run_id = (run_dir / "wandb_id.txt").read_text()
    return list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))


def test_malformed_key_falls_back_offline_with_one_message(tmp_path, wandb_env, caplog):
    wandb_env.setenv("WANDB_API_KEY", "xxx")
    w, warned = _writer(tmp_path / "run", caplog, init_timeout=5)
    assert len(warned) == 1 and warned[0].startswith("wandb: online init failed (AuthenticationError"), warned
    assert "logging offline to the run dir" in warned[0]
    w.log({"loss": 1.0}, step=1)
    w.close()
    assert _offline_runs(tmp_path / "run")


def test_unreachable_server_falls_back_offline(tmp_path, wandb_env, caplog):
    """A 40-character key and a server nobody listens on (no network at all behaves the same)."""
    with socket.socket() as s:  # a port that was free a moment ago: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    wandb_env.setenv("WANDB_API_KEY", KEY40)
    wandb_env.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    w, warned = _writer(tmp_path / "run", caplog, init_timeout=2)
    assert len(warned) == 1 and warned[0].startswith("wandb: online init failed (CommError"), warned
    w.close()
    assert _offline_runs(tmp_path / "run")


@pytest.mark.timeout(90)
def test_silent_server_times_out_then_offline(tmp_path, wandb_env, caplog):
    """A server that accepts connections and never answers: init gives up after init_timeout seconds."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        wandb_env.setenv("WANDB_API_KEY", KEY40)
        wandb_env.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        w, warned = _writer(tmp_path / "run", caplog, init_timeout=2)
    assert len(warned) == 1 and warned[0].startswith("wandb: online init failed (CommError"), warned
    w.close()
    assert _offline_runs(tmp_path / "run")


def test_offline_failing_too_turns_wandb_off(tmp_path, wandb_env, caplog):
    def broken_init(**kw):
        raise OSError("read-only file system")

    import wandb

    wandb_env.setattr(wandb, "init", broken_init)
    wandb_env.setenv("WANDB_API_KEY", KEY40)
    w, warned = _writer(tmp_path / "run", caplog)
    assert warned == [
        "wandb: online init failed (OSError: read-only file system) and offline too (OSError: "
        "read-only file system); wandb is off for this run, metrics.jsonl has every metric."
    ]
    w.log({"loss": 1.0}, step=1)  # a no-op, not an error
    w.close()


@needs_wandb  # as when the whole file was skipped without wandb: logger=wandb is its config group
def test_init_timeout_is_bounded_by_the_config():
    from distckpt.errors import ConfigError
    from launch.config import validate

    assert compose(["logger=wandb"]).logger.wandb_init_timeout == 20.0
    with pytest.raises(ConfigError, match=r"logger.wandb_init_timeout=60.0 is out of range: .* in \(0, 25\]"):
        validate(compose(["logger=wandb", "logger.wandb_init_timeout=60"]))


def test_training_with_a_bad_key_goes_on_and_writes_jsonl(tmp_path, wandb_env, caplog):
    from launch.run import train

    wandb_env.setenv("WANDB_API_KEY", "xxx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PYTHONWARNINGS=ignore: the fallback is still said
        res = train(
            compose(
                [
                    *TINY,
                    "strategy=none",
                    "logger=wandb",
                    "logger.wandb_init_timeout=2",
                    "trainer.max_steps=3",
                    "trainer.save_every=0",
                ]
            ),
            run_dir=tmp_path / "a",
        )
    assert res.step == 3
    said = [m for m in caplog.messages if m.startswith("wandb: online init failed (AuthenticationError")]
    assert len(said) == 1, caplog.messages
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert _offline_runs(tmp_path / "a")
