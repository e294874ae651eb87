"""The order in which tests/conftest.py's xdist scheduler hands out scopes (a module of its own, so that
tests/test_schedule.py imports it whichever conftest.py is first on the path)."""

from __future__ import annotations


def heaviest_first(nodeids: list[str], scope, weights: dict[str, float]) -> list[str]:
    """``nodeids`` grouped by ``scope`` (in the order they were collected within one), heaviest scope first;
    a test without a weight counts 1 s."""
    total: dict[str, float] = {}
    for n in nodeids:
        total[scope(n)] = total.get(scope(n), 0.0) + weights.get(n, 1.0)
    first_seen = {s: k for k, s in enumerate(dict.fromkeys(scope(n) for n in nodeids))}
    return sorted(nodeids, key=lambda n: (-total[scope(n)], first_seen[scope(n)]))
