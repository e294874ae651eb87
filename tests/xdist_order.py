"""tests/conftest.py's xdist scheduler (a module of its own, so that tests/test_schedule.py imports it whichever
conftest.py is first on the path): the tests of a file that defines a module-scoped fixture go to one worker,
every other test to whichever worker is free, the heaviest scope first."""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

_MODULE_FIXTURE = re.compile(r"""scope=["']module["']""")


def file_scope(root: Path) -> Callable[[str], str]:
    """``scope(nodeid)``: the file for a test of a file that defines a module-scoped fixture (a reference run,
    the 4-rank pool, the zoo's report: built once, on one worker), else the test itself. A file that is not on
    disk (a test generated elsewhere) counts as one without."""
    shared: dict[str, bool] = {}

    def scope(nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        if path not in shared:
            file = root / path
            shared[path] = file.is_file() and bool(_MODULE_FIXTURE.search(file.read_text()))
        return path if shared[path] else nodeid

    return scope


def heaviest_first(units: Mapping[str, Iterable[str]], weights: Mapping[str, float]) -> list[str]:
    """The scopes of ``units`` (scope -> its tests' node ids), heaviest first (the sum of its tests' seconds
    in ``weights``; a test without one, such as a file new since tests/durations.txt, counts 1 s), scopes of
    equal weight in the order given (longest-processing-time first: xdist's own order is by test count, which
    leaves a single long test for the end while the other worker idles)."""
    total = {s: sum(weights.get(n, 1.0) for n in tests) for s, tests in units.items()}
    return sorted(total, key=lambda s: -total[s])  # sorted() is stable: ties keep the given order


def scheduler(config: Any, log: Any, scope: Callable[[str], str], weights: Mapping[str, float]) -> Any:
    """An xdist scheduler that hands out whole scopes (``scope(nodeid)``), heaviest first.

    Only the queue of scopes is reordered: each worker is sent indices into its own collection, which is in
    pytest's order (a scheduler that reordered the collections it keeps sent each worker the indices of other
    tests than it meant: measured, the module fixtures of test_torchrun and test_multitask were built twice).
    """
    from xdist.scheduler import LoadScopeScheduling

    class ByScope(LoadScopeScheduling):
        _ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return scope(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            # The first call comes from schedule(), once the queue holds every scope: order it then.
            if not self._ordered:
                self.workqueue = OrderedDict((s, self.workqueue[s]) for s in heaviest_first(self.workqueue, weights))
                self._ordered = True
            super()._assign_work_unit(node)

    return ByScope(config, log)
