"""Launcher tests never reach wandb's servers: no key, mode disabled unless a test says otherwise."""

import pytest


@pytest.fixture(autouse=True)
def _quiet_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
