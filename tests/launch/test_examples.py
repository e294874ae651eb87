"""The commands in examples/*.py docstrings run as written (with fewer steps) on 2 ranks."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys

import pytest
from launchkit import ROOT, env, torchrun

pytestmark = pytest.mark.launch
SHORT = ["trainer=debug", "trainer.max_steps=4", "trainer.save_every=0", "trainer.eval_every=0"]


def _commands(example: str) -> list[list[str]]:
    """The shell commands of an example's docstring (continuation lines joined), split into words."""
    doc = (ROOT / "examples" / example).read_text().split('"""')[1].replace("\\\n", " ")
    return [shlex.split(line) for line in doc.splitlines() if re.match(r"\s+(torchrun|python) ", line)]


def _launcher_overrides(cmd: list[str]) -> list[str]:
    assert cmd[0] == "torchrun" and "launch/train.py" in cmd
    return cmd[cmd.index("launch/train.py") + 1:]


def test_custom_model_and_data_example(tmp_path):
    (cmd,) = _commands("custom.py")
    torchrun([*_launcher_overrides(cmd), *SHORT], tmp_path / "run")
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 4 and {"cls", "reg"} <= last.keys()
    assert last["loss"] == pytest.approx(last["cls"] + 0.5 * last["reg"], rel=1e-5)


def test_lora_fine_tune_example_from_a_tiny_pretrained_directory(tmp_path):
    pytest.importorskip("peft")
    make, cmd = _commands("tiny_pretrained.py")
    pre = str(tmp_path / "gpt2-tiny")
    make = [pre if w == "/tmp/gpt2-tiny" else w for w in make]
    subprocess.run([sys.executable, *make[1:]], cwd=ROOT, env=env(), check=True, timeout=120)
    overrides = [w.replace("/tmp/gpt2-tiny", pre) for w in _launcher_overrides(cmd)]
    torchrun([*overrides, *SHORT], tmp_path / "run")
    assert (tmp_path / "run" / "hf" / "adapter_config.json").is_file()
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"lm", "cls"} <= last.keys()
