"""The doctor's and the plan's factory of a launcher config (``launch/doctor.py``, ``launch/plan.py``): the
model, loss and batches of the job the config describes, built by the launcher's own builders and wrapped by
the ``ac`` group's builder (:func:`launch.ac.wrap_args`) as training wraps it. A module of its own, so that
the ranks unpickle ``launch.subject.build_subject`` by name even when ``launch/doctor.py`` runs as a script
(``__main__``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from omegaconf import DictConfig, open_dict

from distckpt.errors import ConfigError, first_lines


def _compose(overrides: list[str]) -> Any:
    """The launcher's config for ``overrides``.

    Raises:
        ConfigError: a bad override (its first line).
    """
    from launch.check import compose

    try:
        return compose(list(overrides))
    except Exception as e:  # Hydra's own errors name the bad key
        raise ConfigError(f"bad launcher overrides {' '.join(overrides)}: {first_lines(e)}") from e


def compose_job(overrides: list[str] | tuple[str, ...], strategy: str | None = None) -> DictConfig:
    """The launcher's config for ``overrides`` without Hydra's own settings, as the job sees it; ``strategy``
    (``--strategy``) replaces ``strategy.name``.

    Raises:
        ConfigError: a bad override (its first line).
    """
    cfg = _compose(list(overrides))
    job = DictConfig({k: v for k, v in cfg.items() if k != "hydra"})
    if strategy:
        with open_dict(job):
            job.strategy.name = strategy
    return job


def job_world(cfg: DictConfig, nproc: int) -> int:
    """The ranks of the doctor's job: ``nproc``, or one under ``strategy=none``."""
    return 1 if cfg.strategy.name == "none" else nproc


def build_subject(
    overrides: tuple[str, ...], wrap: bool, nproc: int, preserve_rng_state: bool, strategy: str | None = None
) -> tuple:
    """The doctor's factory for a config: ``(model, loss_fn, batch_fn)`` of the launcher's job, wrapped
    as training wraps it when ``wrap`` (the ``ac`` group's arguments for ``strategy``, or the config's, on
    ``nproc`` ranks; a budget planned on one rank's micro-batch; fp32: precision is not applied). Runs on
    every rank."""
    from distckpt.train.data import ShardedLoader
    from launch.ac import wrap_args
    from launch.build import build_datasets, build_model

    cfg = compose_job(overrides, strategy)
    torch.manual_seed(cfg.trainer.seed)
    train_set, _ = build_datasets(cfg.data, cfg.model)
    d = cfg.data
    model = build_model(cfg.model, cfg.data)
    if wrap:
        loader = ShardedLoader(train_set, d.batch_size, rank=0, world_size=nproc)
        wrap_args(cfg, job_world(cfg, nproc)).wrap(
            model, example_inputs=(loader.example(cfg.trainer.grad_accum),), preserve_rng_state=preserve_rng_state
        )

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        return sum(m(batch).values())  # the launcher's loss: the sum of the task losses

    def batch_fn(step: int, rank: int, world: int) -> Any:
        # The launcher's batch of this step for this rank: the loader placed at the step's (epoch, batch).
        loader = ShardedLoader(train_set, d.batch_size, shuffle=d.shuffle, seed=d.seed, rank=rank, world_size=world)
        per_epoch = max(1, len(train_set) // d.batch_size)
        loader.load_state_dict({"epoch": step // per_epoch, "batch": step % per_epoch})
        return loader.next_batch()

    return model, loss_fn, batch_fn
