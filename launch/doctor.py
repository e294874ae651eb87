"""``python launch/doctor.py model=gpt strategy=ddp ... [--steps N]``: ``distckpt doctor`` on the model,
data and checkpointing of the launcher's config, built by the launcher's own builders.

The library's doctor takes a factory (``distckpt doctor --factory pkg.mod:make``); this script is the
factory of a Hydra config, so the library never imports the launcher. ``distckpt doctor <overrides>``,
run from a checkout, delegates here. Exit 0 safe, 1 not safe, 2 bad usage or override.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `launch` and `distckpt` from a checkout

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from distckpt.errors import ConfigError, first_lines  # noqa: E402


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


def _validate(cfg: Any, args: argparse.Namespace) -> None:
    """The launcher's own validation (ranges, combinations, the ``ac`` group on a meta model), for the
    job doctor runs: ``--nproc`` ranks under the config's (or ``--strategy``'s) strategy.

    Raises:
        ConfigError: naming the override to fix.
    """
    from omegaconf import DictConfig, open_dict

    from launch.config import validate

    job = DictConfig({k: v for k, v in cfg.items() if k != "hydra"})
    if args.strategy:
        with open_dict(job):
            job.strategy.name = args.strategy
    validate(job, world_size=1 if job.strategy.name == "none" else args.nproc)


def _parser() -> argparse.ArgumentParser:
    from distckpt.cli import add_doctor_flags

    parser = argparse.ArgumentParser(prog="python launch/doctor.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="+", help="Hydra overrides of the launcher's config (key=value)")
    add_doctor_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Diagnose the config of ``argv``'s overrides and print the verdict.

    Returns:
        The exit code: 0 safe, 1 not safe, 2 bad usage or override.
    """
    from distckpt.check.doctor import doctor
    from distckpt.cli import doctor_options

    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = _compose(args.overrides)
        _validate(cfg, args)
        opts = doctor_options(args, label=" ".join(args.overrides), policy_label=str(cfg.ac.policy))
        opts.strategy = opts.strategy or cfg.strategy.name
        opts.graph = opts.graph or cfg.strategy.graph
        # The config's checkpointing, unless --policy overrides it (then the doctor wraps).
        opts.factory = functools.partial(
            build_subject, tuple(args.overrides), opts.policy is None, opts.nproc, opts.preserve_rng_state
        )
        return doctor(opts)
    except ConfigError as e:
        print(f"distckpt doctor: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    from launch.doctor import main as _main  # by module name: the ranks unpickle launch.doctor.build_subject

    sys.exit(_main())
