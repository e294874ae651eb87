"""``distckpt doctor|plan <overrides>``: the launcher's Hydra config mode, run as ``python launch/doctor.py``
(``launch/plan.py``) of a distckpt checkout. ``launch/`` and ``conf/`` sit beside the ``distckpt`` package in
a checkout and are not part of a wheel, and the library never imports the launcher: the command runs the
checkout's script in a subprocess, from any directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

__all__ = ["SCRIPTS", "checkout", "run_launcher"]

SCRIPTS = {"doctor": Path("launch") / "doctor.py", "plan": Path("launch") / "plan.py"}
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder holding distckpt/: a checkout under pip install -e


def _is_checkout(root: Path) -> bool:
    return all((root / p).is_file() for p in (*SCRIPTS.values(), Path("conf") / "config.yaml"))


def checkout() -> Path | None:
    """The checkout whose launcher the command runs: the one this ``distckpt`` was installed from
    (``pip install -e``, as ``make setup`` does), else the current directory when it is a checkout."""
    return next((root for root in (PACKAGE_ROOT, Path.cwd()) if _is_checkout(root)), None)


def run_launcher(command: str, rest: list[str]) -> int:
    """Run ``launch/<command>.py`` of the :func:`checkout` with ``rest`` (overrides and flags).

    Returns:
        Its exit code, or 2 (said on stderr in one line) when there is no checkout.
    """
    root = checkout()
    script = SCRIPTS[command]
    if root is None:
        print(
            f"distckpt {command}: launcher overrides need a distckpt checkout (its launch/ and conf/), and this "
            f"distckpt ({PACKAGE_ROOT / 'distckpt'}) was not installed from one: install it with pip install -e "
            f"CHECKOUT, or run `python CHECKOUT/{script.as_posix()} model=...`, or use --factory pkg.module:make.",
            file=sys.stderr,
        )
        return 2
    return subprocess.run([sys.executable, str(root / script), *rest], env=dict(os.environ)).returncode
