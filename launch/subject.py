"""The doctor's and the plan's factory of a launcher config (``launch/doctor.py``, ``launch/plan.py``): the
model, loss and batches of the job the config describes, built by the launcher's own builders. A module of
its own, so that the ranks unpickle ``launch.subject.build_subject`` by name even when ``launch/doctor.py``
runs as a script (``__main__``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

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


def build_subject(overrides: tuple[str, ...], wrap: bool, nproc: int, preserve_rng_state: bool) -> tuple:
    """The doctor's factory for a config: ``(model, loss_fn, batch_fn)`` of the launcher's job, wrapped
    as its ``ac`` group says when ``wrap`` (fp32: precision is not applied). Runs on every rank."""
    import distckpt
    from distckpt.train.data import ShardedLoader
    from launch.build import build_datasets, build_model

    cfg = _compose(list(overrides))
    torch.manual_seed(cfg.trainer.seed)
    train_set, _ = build_datasets(cfg.data, cfg.model)
    d = cfg.data
    model = build_model(cfg.model, cfg.data)
    c = cfg.ac
    if wrap:
        example = ShardedLoader(train_set, cfg.data.batch_size, rank=0, world_size=nproc).example()
        distckpt.wrap(
            model,
            c.policy,
            blocks=list(c.blocks) if c.blocks else None,
            reentrant=c.reentrant,
            preserve_rng_state=preserve_rng_state,
            example_inputs=(example,),
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
