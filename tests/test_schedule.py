"""tests/conftest.py's xdist order: the heaviest scope (a file sharing a module fixture, or one test) first."""

from __future__ import annotations

from xdist_order import heaviest_first


def test_heaviest_scope_first_and_a_files_tests_in_their_order():
    ids = ["a.py::t1", "a.py::t2", "b.py::slow", "c.py::t1", "c.py::t2", "d.py::x"]
    grouped = {"a.py", "c.py"}  # files with a module-scoped fixture: one scope each

    def scope(n):
        path = n.split("::")[0]
        return path if path in grouped else n

    weights = {"b.py::slow": 50.0, "c.py::t2": 30.0, "a.py::t1": 2.0}
    # c.py 31 s, b.py::slow 50 s, a.py 3 s, d.py::x 1 s (unlisted)
    assert heaviest_first(ids, scope, weights) == [
        "b.py::slow",
        "c.py::t1",
        "c.py::t2",
        "a.py::t1",
        "a.py::t2",
        "d.py::x",
    ]
