"""TrainState checkpoints in one process, torch only: the config's hyperparameters win over the checkpoint's,
and a checkpoint of another model is refused before anything is loaded."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from distckpt.errors import ResumeError
from distckpt.train import TrainState, load_checkpoint, save_checkpoint


def _state(lr: float, wd: float, betas: tuple[float, float], extra: bool = False) -> TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2), *([nn.Linear(2, 2)] if extra else []))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, betas=betas)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    return TrainState(model, opt, sched)


def _train(state: TrainState, steps: int) -> None:
    for _ in range(steps):
        state.model(torch.randn(3, 4)).square().mean().backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        state.scheduler.step()
        state.step += 1


def test_resume_keeps_the_configured_lr_weight_decay_betas_and_schedule(tmp_path):
    old = _state(1e-3, 0.1, (0.8, 0.9))
    _train(old, 3)
    path = save_checkpoint(old, tmp_path)
    new = _state(5e-4, 0.0, (0.9, 0.99))
    load_checkpoint(new, path)
    group = new.optimizer.param_groups[0]
    assert (group["weight_decay"], group["betas"], group["initial_lr"]) == (0.0, (0.9, 0.99), 5e-4)
    assert new.scheduler.base_lrs == [5e-4] and new.scheduler.last_epoch == 3
    assert group["lr"] == pytest.approx(5e-4 / 4) and new.scheduler.get_last_lr() == [group["lr"]]
    # The state itself comes from the checkpoint: weights, Adam moments, the step.
    assert new.step == 3
    for p_old, p_new in zip(old.model.parameters(), new.model.parameters()):
        assert torch.equal(p_old, p_new)
        assert torch.equal(old.optimizer.state[p_old]["exp_avg"], new.optimizer.state[p_new]["exp_avg"])


def test_resumed_scheduler_state_equals_the_uninterrupted_one(tmp_path):
    # Every entry, not only the lr: the lr recomputation on load once left _step_count one step ahead.
    full = _state(1e-3, 0.1, (0.8, 0.9))
    _train(full, 2)
    path = save_checkpoint(full, tmp_path)
    _train(full, 3)
    resumed = _state(1e-3, 0.1, (0.8, 0.9))
    load_checkpoint(resumed, path)
    _train(resumed, 3)
    assert resumed.scheduler.state_dict() == full.scheduler.state_dict()
    assert resumed.scheduler.state_dict()["_step_count"] == 6  # 1 at construction + 5 steps


def test_checkpoint_of_another_model_is_refused_and_nothing_loaded(tmp_path):
    old = _state(1e-3, 0.1, (0.8, 0.9))
    _train(old, 1)
    path = save_checkpoint(old, tmp_path)
    new = _state(1e-3, 0.1, (0.8, 0.9), extra=True)
    before = [p.detach().clone() for p in new.model.parameters()]
    with pytest.raises(
        ResumeError,
        match=r"missing from the checkpoint: 8 \(2 model, 6 optimizer\), e\.g\. "
        r"model\.3\.bias, model\.3\.weight, optim\.3\.bias\.exp_avg",
    ):
        load_checkpoint(new, path)
    assert new.step == 0 and all(torch.equal(a, b) for a, b in zip(before, new.model.parameters()))
