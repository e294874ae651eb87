"""The launcher's metric writers (``logger=tensorboard``, ``logger=wandb``), fed by the library's MetricSink.

Here and not in ``distckpt/``: the library needs nothing but torch.
"""

from __future__ import annotations

import os
import uuid
import warnings
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

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
    """A wandb run; ``"online"`` without an API key falls back to offline, so a run never prompts or
    waits for a login. The run id lives in the run dir, so a resumed run continues the same wandb run."""

    def __init__(self, run_dir: Path, mode: str, project: str, config: dict[str, Any]) -> None:
        import wandb  # needs the wandb package (extra "launch")

        mode = os.environ.get("WANDB_MODE", mode)  # the user's environment wins (offline on a cluster, ...)
        if mode == "online" and not (os.environ.get("WANDB_API_KEY") or _wandb_logged_in()):
            warnings.warn("wandb: no API key (WANDB_API_KEY or `wandb login`); logging offline to the run dir. "
                          "Sync later with `wandb sync RUN_DIR/wandb`.", stacklevel=3)
            mode = "offline"
        id_file = run_dir / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        id_file.write_text(run_id)
        self._run = wandb.init(project=project, id=run_id, resume="allow", dir=str(run_dir), mode=mode,
                               config=config, settings=wandb.Settings(console="off", silent=True, init_timeout=60))

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


def _wandb_logged_in() -> bool:
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def build_writers(logger: DictConfig, run_dir: str | os.PathLike[str], config: dict[str, Any],
                  enabled: bool) -> list[MetricWriter]:
    """The writers of the ``logger`` group (none on ranks other than 0, where ``enabled`` is False)."""
    if not enabled:
        return []
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    writers: list[MetricWriter] = []
    if logger.tensorboard:
        writers.append(TensorBoardWriter(path))
    if logger.wandb and logger.wandb != "disabled":
        writers.append(WandbWriter(path, logger.wandb, logger.wandb_project, config))
    return writers
