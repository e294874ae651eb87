"""The factory a user's command names (``--factory pkg.module:function``), shared by ``distckpt doctor``
(:mod:`distckpt.check.doctor`, whose docstring states the contract) and ``distckpt plan``
(:mod:`distckpt.cli.plan`)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["load_factory"]


def load_factory(spec: str) -> Callable[[], Any]:
    """Import ``pkg.module:function``.

    Raises:
        ConfigError: the spec is malformed or the module/function cannot be found.
    """
    from distckpt.errors import ConfigError

    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"--factory {spec!r}: expected 'pkg.module:function', e.g. 'mypkg.models:make'.")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: the current directory is importable
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(
            f"--factory {spec!r}: {e}. Check the module is importable from the current "
            "directory (or PYTHONPATH) and defines that function."
        ) from e
    return fn
