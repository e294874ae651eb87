"""tests/conftest.py's xdist scheduler: whole scopes (a file sharing a module fixture, or one test), the heaviest
first, each worker sent the indices of the tests meant for it in its own collection."""

from __future__ import annotations

import pytest
from xdist_order import heaviest_first, scheduler

# In pytest's order: a.py and c.py define a module-scoped fixture (one scope each), b.py and d.py do not.
COLLECTED = ["a.py::t1", "a.py::t2", "b.py::slow", "c.py::t1", "c.py::t2", "d.py::x"]
GROUPED = {"a.py", "c.py"}
WEIGHTS = {"b.py::slow": 50.0, "c.py::t2": 30.0, "a.py::t1": 2.0}  # c.py 31 s, a.py 3 s, d.py::x 1 s (unlisted)


def _scope(nodeid: str) -> str:
    path = nodeid.split("::")[0]
    return path if path in GROUPED else nodeid


def test_heaviest_scope_first_and_ties_in_their_order():
    units = {"a.py": ["a.py::t1", "a.py::t2"], "b.py::slow": ["b.py::slow"], "c.py": ["c.py::t1", "c.py::t2"]}
    units |= {"d.py::x": ["d.py::x"], "e.py::new": ["e.py::new"]}  # e.py: not in tests/durations.txt, 1 s
    assert heaviest_first(units, WEIGHTS) == ["b.py::slow", "c.py", "a.py", "d.py::x", "e.py::new"]


class _Config:
    option = type("Option", (), {"loadscopereorder": True})()

    def getvalue(self, name):
        return {"tx": ["2*popen"]}[name]


class _Node:
    """A worker as the scheduler sees it: it runs the tests at the indices it is sent, in its collection."""

    shutting_down = False

    def __init__(self, name: str):
        self.gateway = type("Gateway", (), {"id": name})()
        self.sent: list[int] = []

    def send_runtest_some(self, indices):
        self.sent.extend(indices)

    def shutdown(self):
        self.shutting_down = True


@pytest.mark.parametrize("extra", [[], ["new.py::t"]], ids=["listed", "a file not in durations.txt"])
def test_each_worker_runs_the_scopes_meant_for_it(extra):
    collected = COLLECTED + extra
    sched = scheduler(_Config(), None, _scope, WEIGHTS)
    nodes = [_Node("gw0"), _Node("gw1")]
    for node in nodes:
        sched.add_node(node)
        sched.add_node_collection(node, collected)
    sched.schedule()
    ran = {node.gateway.id: [collected[i] for i in node.sent] for node in nodes}
    # Heaviest first: b.py::slow to gw0, c.py (both tests, one worker) to gw1; then a.py to gw0 (1 test
    # pending there), d.py::x to gw1; an unlisted test (1 s) comes last, where a worker has room.
    assert ran["gw0"][:3] == ["b.py::slow", "a.py::t1", "a.py::t2"]
    assert ran["gw1"][:3] == ["c.py::t1", "c.py::t2", "d.py::x"]
    for node in nodes:  # every test reported done under its own name: the run ends with nothing pending
        for i in node.sent:
            sched.mark_test_complete(node, i)
    sched.schedule()
    ran = {node.gateway.id: [collected[i] for i in node.sent] for node in nodes}
    assert sorted(ran["gw0"] + ran["gw1"]) == sorted(collected) and not sched.has_pending
