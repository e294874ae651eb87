"""Entry point: ``torchrun --nproc_per_node=N launch/train.py [overrides]`` (also runs with plain ``python``).

Thin on purpose: the overrides are checked first (a bad one exits with code 2 and one or two lines,
before anything is written), then Hydra runs ``train(cfg)`` on the config checked, composed and validated
once (``launch.check.run_checked``); ``@hydra.main`` handles Hydra's own flags (``--cfg``, ``--help``, ``-m``).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

# `python launch/train.py` (and torchrun) puts launch/, not the checkout, first on the path: `launch` and
# `distckpt` from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from launch.check import check_overrides, run_checked  # noqa: E402
from launch.schema import CONF_DIR, register  # noqa: E402
from launch.torchrun import EXIT_CONFIG, EXIT_NONFINITE  # noqa: E402

register()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    job(cfg)


def job(cfg: DictConfig, *, validated: bool = False) -> None:
    """``train(cfg)`` with its errors as exit codes: 2 and one or two lines for a config or resume error, 3 for a
    non-finite stop (rank 0 says it, every rank exits with the code); ``validated``: checked already."""
    import torch.distributed as dist

    from distckpt.errors import ConfigError, ResumeError
    from distckpt.train import NonFiniteLossError
    from launch.run import train

    code = 0
    try:
        train(cfg, validated=validated)
    except (ConfigError, NonFiniteLossError) as e:
        # Raised alike on every rank (the checks and the non-finite decision are the same everywhere):
        # rank 0 says it in one or two lines, every rank exits with the same code.
        kind = (
            "resume error"
            if isinstance(e, ResumeError)
            else "config error"
            if isinstance(e, ConfigError)
            else "stopped"
        )
        code = EXIT_NONFINITE if isinstance(e, NonFiniteLossError) else EXIT_CONFIG
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{kind}: {e}", file=sys.stderr)
    except Exception:
        if not dist.is_initialized():
            raise
        traceback.print_exc()
        code = 1
    if dist.is_initialized():
        # Skip interpreter teardown: destroying a gloo process group from Python can deadlock (see
        # launch/run.py), which would leave torchrun waiting forever. Everything is written and closed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    checked = check_overrides(sys.argv[1:])  # exits 2 on a bad override; `--check` stops after it
    if checked is None:  # Hydra's own flags
        main()
    else:
        run_checked(checked, lambda cfg: job(cfg, validated=True))
