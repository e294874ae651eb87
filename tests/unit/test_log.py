"""``distckpt._log.notify``: a run-safety message reaches the user whatever the warnings filters say (the
``distckpt`` logger), as a warning too where asked, and a script without logging is not told twice."""

from __future__ import annotations

import logging
import warnings

import pytest

from distckpt._log import Notice, RuntimeNotice, first_few, notify

MSG = "a checkpoint was skipped"


def _logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "distckpt" and r.levelno == logging.WARNING]


def test_logged_and_warned_when_warnings_show():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        notify(MSG)
    assert [(w.category, str(w.message)) for w in caught] == [(Notice, MSG)]
    assert issubclass(Notice, UserWarning)  # pytest.warns(UserWarning) and filters on UserWarning still see it


def test_logged_when_warnings_are_ignored(caplog):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("ignore")  # PYTHONWARNINGS=ignore
        notify(MSG)
    assert caught == [] and _logged(caplog) == [MSG]


def test_warn_false_only_logs(caplog):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        notify(MSG, warn=False)
    assert caught == [] and _logged(caplog) == [MSG]


def test_runtime_warning_category():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        notify(MSG, category=RuntimeWarning)
    assert caught[0].category is RuntimeNotice and issubclass(RuntimeNotice, RuntimeWarning)


def _library_call() -> None:
    notify(MSG, stacklevel=2)  # attributed to the caller's line, as warnings.warn(..., stacklevel=2)


@pytest.mark.parametrize("ignored", [False, True])
def test_a_script_without_logging_is_told_once(monkeypatch, capsys, ignored):
    """No handler anywhere (a plain script): Python's last-resort handler prints a WARNING record to stderr, so the
    record is made only when the warning does not show. The filter is read as warnings.warn reads it: here one
    that ignores this module's warnings, where the warning is attributed (stacklevel=2)."""
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if ignored:
            warnings.filterwarnings("ignore", module=__name__)
        _library_call()
    assert len(caught) == (0 if ignored else 1)
    assert capsys.readouterr().err.count(MSG) == (1 if ignored else 0)


def test_first_few_lists_n_and_counts_the_rest():
    items = [f"p{i}" for i in range(7)]
    assert first_few(items) == "p0; p1; p2; p3; p4 (and 2 more)"
    assert first_few(items, 8, ", ") == ", ".join(items)
    assert first_few([]) == ""
