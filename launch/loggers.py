"""The launcher's metric writers (``logger=tensorboard``, ``logger=wandb``), fed by the library's MetricSink.

Here and not in ``distckpt/``: the library needs nothing but torch.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from distckpt._log import notify
from distckpt.errors import error_line
from distckpt.train.metrics import MetricWriter


class TensorBoardWriter:
    """TensorBoard events under ``run_dir/tb``."""

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self._tb = SummaryWriter(log_dir=str(run_dir / "tb"))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for k, v in scalars.items():
            self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._tb.close()


class WandbWriter:
    """A wandb run that never blocks or ends the training run.

    ``"online"`` without an API key goes offline at once, so a run never prompts for a login. Any
    failure of ``wandb.init`` (a malformed key, an unreachable server, no answer within
    ``init_timeout`` seconds) is one message on the ``distckpt`` logger (rank 0's log: no warnings filter
    hides it) and an offline run in the run dir instead; should that fail too, wandb is off for the run.
    ``metrics.jsonl`` is written in every case. The run id lives in the run dir, so a resumed run continues
    the same wandb run.
    """

    def __init__(
        self, run_dir: Path, mode: str, project: str, config: dict[str, Any], init_timeout: float = 20.0
    ) -> None:
        import wandb  # needs the wandb package (extra "launch")

        mode = os.environ.get("WANDB_MODE", mode)  # the user's environment wins (offline on a cluster, ...)
        if mode == "online" and not (os.environ.get("WANDB_API_KEY") or _wandb_logged_in()):
            notify(
                "wandb: no API key (WANDB_API_KEY or `wandb login`); logging offline to the run dir. "
                "Sync later with `wandb sync RUN_DIR/wandb`.",
                warn=False,
            )
            mode = "offline"
        id_file = run_dir / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id)
        # init_timeout bounds wandb's wait for its server (measured with wandb 0.31: a 40-character key
        # and no network fails after init_timeout + ~1.5 s; a malformed key fails at once).
        settings = wandb.Settings(console="off", silent=True, init_timeout=init_timeout)
        kwargs = dict(project=project, id=run_id, resume="allow", dir=str(run_dir), config=config, settings=settings)
        self._run = _init_or_offline(wandb, mode, kwargs)

    def log(self, scalars: dict[str, float], step: int) -> None:
        if self._run is not None:
            self._run.log(scalars, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()


def _init_or_offline(wandb: Any, mode: str, kwargs: dict[str, Any]) -> Any:
    """``wandb.init`` in ``mode``; on any failure one message and an offline run (None if that fails too)."""
    try:
        return wandb.init(mode=mode, **kwargs)
    except Exception as e:  # AuthenticationError, CommError (timeout, no network), UsageError, ...: never fatal
        if mode != "online":
            notify(
                f"wandb: init in mode {mode} failed ({error_line(e)}); wandb is off for this run, "
                "metrics.jsonl has every metric.",
                warn=False,
            )
            return None
        first = error_line(e)
    try:
        # The failed online run stays registered in wandb's service (measured, wandb 0.31: an offline
        # init with the same id then fails "run ID is in use"), and the service keeps the settings it
        # read first: start a fresh one.
        wandb.teardown()
        run = wandb.init(mode="offline", **kwargs)
    except Exception as e:
        notify(
            f"wandb: online init failed ({first}) and offline too ({error_line(e)}); wandb is off for "
            "this run, metrics.jsonl has every metric.",
            warn=False,
        )
        return None
    notify(
        f"wandb: online init failed ({first}); logging offline to the run dir instead "
        "(sync later with `wandb sync RUN_DIR/wandb`).",
        warn=False,
    )
    return run


def _wandb_logged_in() -> bool:
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def build_writers(
    logger: DictConfig, run_dir: str | os.PathLike[str], config: dict[str, Any], enabled: bool
) -> list[MetricWriter]:
    """The writers of the ``logger`` group (none on ranks other than 0, where ``enabled`` is False)."""
    if not enabled:
        return []
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    writers: list[MetricWriter] = []
    if logger.tensorboard:
        writers.append(TensorBoardWriter(path))
    if logger.wandb and logger.wandb != "disabled":
        writers.append(
            WandbWriter(path, logger.wandb, logger.wandb_project, config, init_timeout=logger.wandb_init_timeout)
        )
    return writers
