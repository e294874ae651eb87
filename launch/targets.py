"""``_target_`` config groups (``model=custom``, ``data=custom``): checked before torchrun starts, built
with ``hydra.utils.instantiate`` (lightning-hydra-template style).

The group's other keys are the target's keyword arguments, except the launcher's own keys of that
group (``LAUNCHER_KEYS``: the loader's batch size, shuffling, ...). A target that cannot be imported,
does not take those arguments, raises, or returns the wrong kind of object is a ``ConfigError``
naming it: ``launch/train.py`` prints it in a line or two and exits 2.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from omegaconf import DictConfig, OmegaConf

from distckpt.errors import ConfigError, first_lines

# Keys of a group the launcher reads itself; everything else goes to the target.
LAUNCHER_KEYS = {
    "model": ("name",),
    "data": ("name", "batch_size", "seed", "shuffle", "drop_last", "num_workers", "pin_memory", "eval"),
}


def target_kwargs(node: DictConfig, group: str) -> dict[str, Any]:
    """The target's keyword arguments from ``node`` (``_target_`` included, the launcher's keys left out)."""
    return {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k not in LAUNCHER_KEYS[group]}


def check_target(node: DictConfig, group: str) -> None:
    """Import ``node._target_`` and bind its keyword arguments to its signature, without calling it.

    Raises:
        ConfigError: it cannot be imported, is not callable, or does not take the keyword arguments.
    """
    from hydra.utils import get_object

    kwargs = target_kwargs(node, group)
    target = kwargs.pop("_target_")
    quiet = logging.getLogger("hydra.utils")  # it logs the failure in three lines of its own; ours is enough
    was, quiet.disabled = quiet.disabled, True
    try:
        obj = get_object(target)
    except Exception as e:  # ImportError, AttributeError from the user's module: all mean "cannot import"
        raise ConfigError(
            f"{group}._target_={target} cannot be imported ({first_lines(e.__cause__ or e, 2)}); "
            "give a dotted path module.name whose package is importable (on PYTHONPATH)."
        ) from None
    finally:
        quiet.disabled = was
    if not callable(obj):
        raise ConfigError(f"{group}._target_={target} is a {type(obj).__name__}, not a class or function.")
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without a signature: the call will tell
        return
    try:
        signature.bind(**kwargs)
    except TypeError as e:
        raise ConfigError(
            f"{group}._target_={target} cannot be called with the arguments {sorted(kwargs)} ({e}); "
            f"fix the +{group}.KEY=VALUE overrides to match {target}{signature}."
        ) from None


def instantiate_target(node: DictConfig, group: str, expect: tuple[type, ...], what: str, **overrides: Any) -> Any:
    """Call ``node._target_`` with its keyword arguments (and ``overrides``) and check what it returns.

    Raises:
        ConfigError: as :func:`check_target`, or the call raised, or it returned something not ``expect``.
    """
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    check_target(node, group)
    kwargs = {**target_kwargs(node, group), **overrides}
    target = kwargs["_target_"]
    try:
        obj = instantiate(kwargs, _convert_="all")
    except InstantiationException as e:
        raise ConfigError(f"{group}._target_={target} raised when called: {first_lines(e, 2)}") from e
    if not isinstance(obj, expect):
        raise ConfigError(f"{group}._target_={target} returned a {type(obj).__name__}; it must return {what}.")
    return obj


def check_targets(cfg: DictConfig) -> None:
    """:func:`check_target` for each group of ``cfg`` that names a ``_target_`` (``--check`` runs it).

    Raises:
        ConfigError: as :func:`check_target`.
    """
    for group in LAUNCHER_KEYS:
        node = cfg.get(group)
        if isinstance(node, DictConfig) and "_target_" in node:
            check_target(node, group)
