"""Check command-line overrides before Hydra runs: a bad one exits with code 2 and one or two lines; then run the
job on the config checked, composed once."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from omegaconf import DictConfig

from distckpt.errors import first_lines
from launch.schema import CONF_DIR
from launch.torchrun import EXIT_CONFIG


def explain(e: BaseException) -> str:
    """One or two lines from a Hydra/OmegaConf composition error: what is wrong and which override to fix."""
    from distckpt.errors import ConfigError

    if isinstance(e, ConfigError):
        return str(e)
    msg = first_lines(e)
    cause = e.__cause__ or e.__context__
    key = getattr(cause, "full_key", None) or getattr(e, "full_key", None)
    if cause is not None and first_lines(cause) != msg:
        msg = f"{msg}: {first_lines(cause)}"
    if "Could not override" in msg or "not in struct" in msg:
        return f"{msg}\nunknown key: check its spelling against conf/ (python launch/train.py --cfg job lists them)."
    if "Could not find" in msg or "Could not load" in msg:
        group = msg.split("'")[3].split("/")[0] if msg.count("'") >= 4 else ""
        options = sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml")) if group else []
        if options:
            return f"{msg}\nchoose one of: {', '.join(f'{group}={o}' for o in options)}."
        return f"{msg}\nchoose one of the files in conf/<group>/ (e.g. strategy=ddp)."
    if key:
        return f"{msg}\nfix the override {key}=..."
    return msg


# Config groups renamed: old name -> new name. The old `ckpt` (activation checkpointing) read as the
# DCP checkpoints of `checkpoints/` and `trainer.save_every`.
RENAMED_GROUPS = {"ckpt": "ac"}


def refuse_renamed(overrides: list[str]) -> None:
    """Raise on an override that uses a renamed group (``ckpt=full``, ``ckpt.policy=...``, ``+ckpt.x=1``).

    Raises:
        ConfigError: naming the group's new name and the override to write instead.
    """
    from distckpt.errors import ConfigError

    for o in overrides:
        key, eq, value = o.lstrip("+~").partition("=")
        group, _, rest = key.partition(".")
        if group in RENAMED_GROUPS:
            new = RENAMED_GROUPS[group] + (f".{rest}" if rest else "") + (f"{eq}{value}" if eq else "")
            raise ConfigError(
                f"the config group `{group}` is now called `{RENAMED_GROUPS[group]}`: write {new} instead of {o}."
            )


def compose(overrides: list[str]) -> DictConfig:
    """Compose ``conf/config.yaml`` with ``overrides`` as ``@hydra.main`` would (Hydra settings included).

    Raises:
        ConfigError: an override uses a renamed group (see :func:`refuse_renamed`).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from launch.schema import CONF_DIR, register

    refuse_renamed(overrides)
    register()
    # job_name: what @hydra.main names the job of launch/train.py (hydra.job.name).
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3", job_name="train"):
        return hydra_compose(config_name="config", overrides=overrides, return_hydra_config=True)


def check_overrides(argv: list[str]) -> DictConfig | None:
    """Compose and validate; on an error print it (rank 0) and exit 2. With ``--check``, exit 0 when fine.

    Returns:
        The config checked, Hydra settings included (for :func:`run_checked`); None for Hydra's own flags
        (``--cfg``, ``--help``, ``-m``: ``@hydra.main`` handles those).
    """
    from launch.config import validate
    from launch.targets import check_targets

    only_check = "--check" in argv
    if only_check:
        argv.remove("--check")
        sys.argv.remove("--check")
    if any(a.startswith("-") for a in argv):  # Hydra's own flags (--cfg, --help, -m): Hydra handles those
        return None
    try:
        cfg = compose(argv)
        cfg_job = DictConfig({k: v for k, v in cfg.items() if k != "hydra"})
        validate(cfg_job, int(os.environ.get("WORLD_SIZE", "1")) if not only_check else _world_hint(argv))
        check_targets(cfg_job)  # model=custom / data=custom: importable, and takes its arguments
    except Exception as e:  # every composition error becomes one short message
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"config error: {explain(e)}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    if only_check:
        sys.exit(0)
    return cfg


def run_checked(cfg: DictConfig, task: Callable[[DictConfig], None]) -> None:
    """Run ``task`` on the job's part of ``cfg`` (from :func:`check_overrides`) as ``@hydra.main`` runs its
    function: Hydra's logging and run-folder setup (``hydra.run.dir`` made, ``HydraConfig`` set), by Hydra's own
    ``run_job``. ``@hydra.main`` would compose the config twice more (once for its mode, once for the run):
    about 0.25 s of CPU per rank, measured.

    Raises:
        Exception: what ``task`` raised (``@hydra.main`` prints it and exits 1; here Python does).
    """
    from hydra._internal.callbacks import Callbacks
    from hydra.core.utils import configure_log, run_job, setup_globals
    from hydra.types import HydraContext, RunMode

    setup_globals()  # Hydra's resolvers (now, hydra, python_version), as @hydra.main registers them
    configure_log(cfg.hydra.hydra_logging, cfg.hydra.verbose)
    cfg.hydra.mode = RunMode.RUN
    callbacks = Callbacks(cfg)  # hydra.callbacks, if a config names any
    callbacks.on_run_start(config=cfg, config_name="config")
    # config_loader: read by Hydra's sweepers only (multirun, which goes through @hydra.main).
    ret = run_job(
        task_function=task,
        config=cfg,
        job_dir_key="hydra.run.dir",
        job_subdir_key=None,
        hydra_context=HydraContext(config_loader=None, callbacks=callbacks),
    )
    callbacks.on_run_end(config=cfg, config_name="config", job_return=ret)
    _ = ret.return_value  # raises the task's exception, if it raised


def _world_hint(argv: list[str]) -> int:
    # `--check` runs before torchrun (make train): the job's size comes from the environment.
    return int(os.environ.get("DISTCKPT_NPROC", os.environ.get("WORLD_SIZE", "1")))
