"""`distckpt doctor` end to end: 2 CPU ranks on a healthy model (exit 0) and on broken ones (exit 1,
the cause named). The example factories below follow the contract in distckpt.check.doctor."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import distckpt
import distckpt._spawn as spawn
from distckpt.cli import main

pytestmark = pytest.mark.dist
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture(autouse=True)
def _pooled_ranks(dist_pool, monkeypatch):
    """doctor's ranks, in this process's runs, are the session's 2-rank pool (tests/harness.py): a fresh
    spawn per doctor run (several for a suggestion it re-verifies) cost seconds of imports each. The spawn
    itself runs in test_console_script_spawns_its_ranks_and_exits_1 (a fresh process) and in
    tests/distributed/test_spawn.py; another world size still spawns."""
    spawned = spawn.run_ranks

    def run_ranks(target, world, *args, timeout=300.0, **kwargs):
        if world != dist_pool.world_size:
            return spawned(target, world, *args, timeout=timeout, **kwargs)
        return dict(enumerate(dist_pool.run(target, *args, timeout=timeout)))

    monkeypatch.setattr(spawn, "run_ranks", run_ranks)


class Block(nn.Module):
    def __init__(self, d: int = 16, p: float = 0.1) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(d, 2 * d), nn.Dropout(p), nn.Linear(2 * d, d)
        self.task_b = False  # a task switch read inside the block
        self.extra = False  # another one, which changes the ops (and so the tensors saved for backward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.fc1(x)))
        if self.extra:
            h = torch.sin(h)
        return x + self.fc2(h * 2 if self.task_b else h)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
    n = 8 // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def _mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def healthy():
    """Dropout, checkpointed with distckpt's defaults."""
    return Net(), _mse, _batch


def broken_rng():
    """Dropout recomputed without the forward's RNG state."""
    return distckpt.wrap(Net(), "full", preserve_rng_state=False), _mse, _batch


def broken_flag():
    """A task flag read inside a checkpointed block, switched back before backward."""

    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inner = getattr(model, "module", model)
        inner.blocks[1].task_b = True
        out = _mse(model, batch)
        inner.blocks[1].task_b = False
        return out

    return Net(), loss, _batch


def _flags_read_in_blocks(flags: dict[int, str]):
    """A loss that sets a flag in some blocks for the forward and switches it back before backward."""

    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inner = getattr(model, "module", model)
        for i, name in flags.items():
            setattr(inner.blocks[i], name, True)
        out = _mse(model, batch)
        for i, name in flags.items():
            setattr(inner.blocks[i], name, False)
        return out

    return loss


def broken_two_blocks():
    """Blocks 1 and 2 both read a flag that changes before backward."""
    return Net(), _flags_read_in_blocks({1: "task_b", 2: "task_b"}), _batch


def broken_hidden():
    """Block 2's recompute saves fewer tensors (torch's CheckpointError stops the backward there), which
    hides block 0's flag: the first fix (leave out block 2) is still broken."""
    return Net(), _flags_read_in_blocks({0: "task_b", 2: "extra"}), _batch


def nan_loss():
    """A loss that is always nan, with and without checkpointing."""

    def loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return _mse(model, batch) * float("nan")

    return Net(), loss, _batch


def raising():
    raise RuntimeError("cannot open /data/weights.pt")


def test_healthy_model_is_safe(capsys):
    code = main(["doctor", "--factory", "test_doctor:healthy", "--steps", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "NOT OK" not in out and "verdict: SAFE" in out
    assert "3 checkpointed block(s): blocks.0, blocks.1, blocks.2" in out
    assert "recompute is exact" in out and "gradients identical across 2 ranks" in out
    assert "every trainable parameter got a gradient" in out
    assert "blocks.0" in out.split("per checkpointed block")[1]  # the memory/recompute estimate
    assert 'distckpt.wrap(model, "full", reentrant=False, preserve_rng_state=True)' in out


def test_dropout_without_rng_state_is_not_safe(capsys):
    code = main(["doctor", "--factory", "test_doctor:broken_rng", "--steps", "1"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "[NOT OK] blocks.0.drop [rng]" in out
    blocks = "blocks=['blocks.0', 'blocks.1', 'blocks.2']"  # the factory wrapped them itself
    assert f'Settings tried: distckpt.wrap(model, "full", reentrant=False, preserve_rng_state=False, {blocks})' in out
    assert f'settings to try: distckpt.wrap(model, "full", reentrant=False, preserve_rng_state=True, {blocks})' in out
    assert "(doctor ran them: SAFE)" in out


def test_console_script_spawns_its_ranks_and_exits_1():
    """The installed `distckpt` command, in a fresh process that spawns its 2 ranks (the other tests' doctor
    runs use the session's pool): exit code 1 and the finding printed. On a model no checkpointing setting
    fixes (a nan loss): one spawn, where a fix doctor re-verifies would spawn again (the flag read in a block,
    whose finding and fix test_flag_read_in_block_is_named_and_left_out checks in this process)."""
    exe = os.path.join(os.path.dirname(sys.executable), "distckpt")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "distckpt.cli"]
    proc = subprocess.run(
        [*cmd, "doctor", "--factory", "test_doctor:nan_loss", "--steps", "1"],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "(2 CPU rank(s), 1 step(s))" in proc.stdout, proc.stdout
    assert "[NOT OK] the step [nonfinite]" in proc.stdout and "verdict: NOT SAFE" in proc.stdout


def test_flag_read_in_block_is_named_and_left_out(capsys):
    """Exit code 1, the block named, and the verified fix leaves it out."""
    code = main(["doctor", "--factory", "test_doctor:broken_flag", "--steps", "1"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "[NOT OK] blocks.1 [control_flow]" in out, out
    assert "between forward and backward" in out
    assert "blocks=['blocks.0', 'blocks.2']" in out  # the block to leave out


def test_usage_errors_exit_2(capsys):
    assert main(["doctor"]) == 2
    assert main(["doctor", "--factory", "no_such_module_xyz:make"]) == 2
    assert "no_such_module_xyz" in capsys.readouterr().err


def test_hydra_config_mode(capsys, monkeypatch):
    """`python launch/doctor.py model=... strategy=...`: the launcher's config, built by its builders."""
    pytest.importorskip("hydra")
    monkeypatch.chdir(ROOT)  # the checkout's root: launch/ and conf/
    monkeypatch.syspath_prepend(ROOT)
    from launch.doctor import main as launch_doctor

    code = launch_doctor(["model=mlp", "data=synthetic", "strategy=fsdp2", "--steps", "1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "strategy=fsdp2" in out and "4 checkpointed block(s)" in out and "verdict: SAFE" in out
    assert 'distckpt.parallelize(model, "fsdp2", graph="auto")' in out
    assert launch_doctor(["model=no_such_model"]) == 2


def test_overrides_delegate_to_the_launcher_from_any_directory(capfd, monkeypatch, tmp_path):
    """`distckpt doctor <overrides>` runs `launch/doctor.py` of the checkout distckpt was installed from (pip
    install -e) with the same arguments, wherever it is run (measured before: only from the checkout's root)."""
    pytest.importorskip("hydra")
    monkeypatch.chdir(tmp_path)  # no launch/ here
    assert main(["doctor", "model=no_such_model", "--steps", "1"]) == 2  # the launcher's own error, exit 2
    assert "bad launcher overrides model=no_such_model" in capfd.readouterr().err


def test_overrides_without_a_checkout_exit_2(capsys, monkeypatch, tmp_path):
    """A distckpt installed from a wheel has no launcher: one line that says what to do."""
    import distckpt.cli.launcher as launcher

    monkeypatch.setattr(launcher, "PACKAGE_ROOT", tmp_path / "site-packages")
    monkeypatch.chdir(tmp_path)  # not a checkout either
    assert main(["doctor", "model=gpt"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "pip install -e CHECKOUT" in err and "python CHECKOUT/launch/doctor.py" in err and "--factory" in err
    monkeypatch.chdir(ROOT)  # run from a checkout, a wheel's command uses that checkout's launcher
    assert launcher.checkout() == launcher.Path(ROOT)


def test_nan_loss_is_not_safe(capsys):
    """Measured before: "verdict: SAFE", exit 0 (max(0.0, nan) in the reference comparison)."""
    code = main(["doctor", "--factory", "test_doctor:nan_loss", "--steps", "2"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "verdict: NOT SAFE" in out
    assert "[NOT OK] the step [nonfinite]: the loss is not finite with and without checkpointing" in out
    assert "[NOT OK] step 0: loss nan, global gradient norm nan" in out
    assert "no checkpointing setting that doctor tried passes" in out and "settings to try" not in out


def test_factory_that_raises_is_a_usage_error(capsys):
    code = main(["doctor", "--factory", "test_doctor:raising", "--steps", "1"])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.strip().splitlines() == [
        "distckpt doctor: the factory test_doctor:raising raised RuntimeError: cannot open /data/weights.pt "
        "(rank 0); doctor diagnoses a model it can build."
    ]
    assert "NOT SAFE" not in captured.out


def test_two_broken_blocks_are_both_left_out(capsys):
    code = main(["doctor", "--factory", "test_doctor:broken_two_blocks", "--steps", "1"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert (
        'settings to try: distckpt.wrap(model, "full", reentrant=False, preserve_rng_state=True, '
        'blocks=[\'blocks.0\']); distckpt.parallelize(model, "ddp", graph="auto")  (doctor ran them: SAFE)'
    ) in out


def test_suggestion_is_re_verified_when_a_failure_hides_another(capsys):
    """Leaving out block 2 (the one torch's CheckpointError names) is not enough: doctor runs that, finds
    block 0, and suggests only what passed."""
    code = main(["doctor", "--factory", "test_doctor:broken_hidden", "--steps", "1"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "[NOT OK] blocks.2 [control_flow]" in out and "blocks.0 [" not in out  # the first run sees block 2 only
    assert "blocks=['blocks.1']); distckpt.parallelize" in out and "(doctor ran them: SAFE)" in out


def test_hydra_config_mode_validates_the_config_first(capsys, monkeypatch):
    """An out-of-range override is refused before any rank starts, as `launch/train.py --check` refuses it."""
    pytest.importorskip("hydra")
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(ROOT)
    from launch.doctor import main as launch_doctor

    assert launch_doctor(["model=gpt", "model.n_layer=0", "--steps", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "distckpt doctor: model.n_layer=0 is out of range: it must be an integer >= 1; fix the override "
        "model.n_layer=..."
    ]
