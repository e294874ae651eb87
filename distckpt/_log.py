"""Saying to the user what a run's safety depends on (a checkpoint skipped, a logger's fallback, a cache turned
off, a plan redone): through logging, which a warnings filter cannot silence, and as a warning where a library
user expects one."""

from __future__ import annotations

import logging
import sys
import warnings

__all__ = ["Notice", "RuntimeNotice", "notify"]

logger = logging.getLogger("distckpt")


class Notice(UserWarning):
    """A warning that :func:`notify` also logged. A program that shows the ``distckpt`` logger (the launcher, on
    rank 0) ignores these (``warnings.filterwarnings("ignore", category=Notice)``), so each thing is said once."""


class RuntimeNotice(Notice, RuntimeWarning):
    """:class:`Notice` of a ``RuntimeWarning``."""


_NOTICES: dict[type[Warning], type[Notice]] = {UserWarning: Notice, RuntimeWarning: RuntimeNotice}


def notify(msg: str, *, warn: bool = True, category: type[Warning] = UserWarning, stacklevel: int = 1) -> None:
    """Tell the user ``msg``: a WARNING record of the ``distckpt`` logger and, with ``warn``, a warning too.

    The record goes wherever the program's logging sends it (the launcher prints rank 0's); a program that
    configured no logging gets it on stderr from Python's last-resort handler, unless the warning printed it
    already. So ``PYTHONWARNINGS=ignore`` (common in training scripts) never hides it, and a script without
    logging is not told twice.

    Args:
        msg: the message: what happened and what to do about it.
        warn: also warn (a library call a user makes, whose warnings they or their tests look for).
        category: ``UserWarning`` or ``RuntimeWarning``; the warning is its :class:`Notice` subclass.
        stacklevel: as ``warnings.warn``'s, counted from the caller of ``notify`` (1: the line calling it).
    """
    shown = False
    if warn:
        notice = _NOTICES[category]
        shown = not _ignored(msg, notice, stacklevel + 1)
        warnings.warn(msg, notice, stacklevel=stacklevel + 1)
    if not shown or logger.hasHandlers():
        logger.warning(msg)


def _ignored(text: str, category: type[Warning], stacklevel: int) -> bool:
    """Whether the warnings filters drop the warning that the caller of this function issues with
    ``warnings.warn(text, category, stacklevel)``: the action of the first filter that matches it (its text,
    category, and the module and line it is attributed to), as ``warnings.warn`` reads them."""
    try:
        frame = sys._getframe(stacklevel)  # 0 is this function, 1 its caller: warnings.warn's stacklevel 1
        module, lineno = frame.f_globals.get("__name__", "<string>"), frame.f_lineno
    except ValueError:  # fewer frames than stacklevel: warnings attributes it to sys
        module, lineno = "sys", 1
    for action, message, cat, mod, line in warnings.filters:
        if (
            (message is None or message.match(text))
            and issubclass(category, cat)
            and (mod is None or mod.match(module))
            and line in (0, lineno)
        ):
            return action == "ignore"
    return warnings.defaultaction == "ignore"


def first_few(items: list[str], n: int = 5, sep: str = "; ") -> str:
    """The first ``n`` of ``items`` joined by ``sep``, and how many more there are: how an error lists problems
    (a guard's parameters that differ, the ones with no gradient) without a thousand-line message."""
    return sep.join(items[:n]) + (f" (and {len(items) - n} more)" if len(items) > n else "")
