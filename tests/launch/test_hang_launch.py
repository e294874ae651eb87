"""``strategy.hang_timeout``: the launcher's knob for distckpt's hang watchdog reaches ``parallelize``, a bad value is
refused by --check's validation naming the setting, and torchrun's wrapper knows the watchdog's exit code (the workers
already said what happened: no ChildFailedError report on top)."""

from __future__ import annotations

import pytest
from launchkit import TINY, compose

import distckpt
import launch.run
from distckpt.errors import ConfigError
from distckpt.parallel.watchdog import EXIT_HANG
from launch.config import validate
from launch.run import train
from launch.torchrun import EXIT_HANG as LAUNCH_EXIT_HANG
from launch.torchrun import EXPLAINED

RUN = [*TINY, "strategy=none", "trainer.max_steps=1", "trainer.save_every=1"]


@pytest.mark.parametrize(
    ("override", "want"), [([], 300.0), (["strategy.hang_timeout=7"], 7.0), (["strategy.hang_timeout=null"], None)]
)
def test_hang_timeout_reaches_parallelize(tmp_path, monkeypatch, override, want):
    seen, real = {}, distckpt.parallelize

    def parallelize(model, strategy, **kwargs):
        seen.update(kwargs)
        return real(model, strategy, **kwargs)

    monkeypatch.setattr(launch.run.distckpt, "parallelize", parallelize)
    train(compose([*RUN, *override]), run_dir=tmp_path)
    assert seen["hang_timeout"] == want


def test_bad_hang_timeout_is_refused():
    with pytest.raises(ConfigError, match=r"strategy.hang_timeout=-5.*null"):
        validate(compose([*RUN, "strategy.hang_timeout=-5"]), world_size=1)


def test_torchrun_knows_the_exit_code():
    assert LAUNCH_EXIT_HANG == EXIT_HANG and EXIT_HANG in EXPLAINED
