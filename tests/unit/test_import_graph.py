"""Imports form a DAG: no circle in ``distckpt/`` or ``launch/``, and ``distckpt/``'s layers point down.

Every import statement counts: lazy ones inside functions, those under ``if TYPE_CHECKING:`` and under
``if __name__ == "__main__":`` (a circle hidden in a function still means that neither module can be read,
or changed, without the other). An import is an edge to the module it names, resolved as Python does:

- ``import a.b.c`` and ``from a.b.c import x`` name ``a.b.c``; ``from a.b import c`` names the submodule
  ``a.b.c`` when there is one (``from distckpt import _torch_compat``, ``from distckpt.select import
  budget``), else the package ``a.b`` itself (``from distckpt import wrap``: a name its ``__init__`` defines).
- Importing a module first runs the ``__init__`` of each package above it. The importer's own packages have
  run already (or are the ones running this import), and reaching a submodule of a package whose
  ``__init__`` is still running works, so those add nothing; every other package above the named module is
  an edge too (a module outside ``distckpt/train/`` that imports ``distckpt.train.data`` also runs
  ``distckpt/train/__init__.py``, which imports the loop). So a package ``__init__`` importing its own
  submodules (``distckpt/__init__.py`` re-exporting the API) is no circle, but a submodule that takes a
  name from its package's ``__init__`` is one.
- A module importing itself is a circle of one (``python launch/x.py`` importing ``launch.x``: two copies).

The layers of ``distckpt/`` (:data:`LAYERS`, bottom first): a module imports its own layer and those below.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# distckpt/'s layers, bottom first, by the first name under distckpt ("" is distckpt/__init__.py, the API).
# A new package or top-level module goes in one of them; see the module docstring for what counts.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "_log", "_torch_compat", "_dist", "_spawn", "options", "layout", "factory"),  # no distckpt layer needed
    ("runtime",),  # the checkpointed block: class swap, recompute run-time, op-level contexts
    ("select",),  # what to checkpoint: policies over the budget planner over the profiler (SELECT_LAYERS)
    ("apply",),  # wrap: the policy resolved and the run-time placed on the chosen blocks; chunked FFN
    ("parallel",),  # DDP / FSDP / FSDP2 / HSDP around checkpointed blocks
    ("check",),  # run-time proof: guards, recompute check, doctor
    ("train",),  # loop pieces the launcher composes
    ("", "cli", "integrations"),  # the public API, the commands (doctor, plan), optional framework integrations
)

# Inside distckpt/select/, bottom first: the profiler, what a policy sees (candidates), the block finder and the
# tensor-parallel shapes (tp_shapes), the
# memory planner, the policy objects, and the package's public names ("": select/__init__.py).
SELECT_LAYERS: tuple[tuple[str, ...], ...] = (
    ("profile",),
    ("candidates", "blocks", "tp_shapes"),
    ("budget",),
    ("policies",),
    ("",),
)

Edges = dict[str, dict[str, int]]  # module -> {imported module: line of the first such import}


def modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Every module of ``packages`` (folders under ``root``) by dotted name; a package by its own name."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _named(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: dict[str, Path]) -> list[str]:
    """The modules one import statement names (see the module docstring), before parent packages."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the importer's package, one level up per extra dot
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]


def _with_parents(importer: str, named: str, known: dict[str, Path]) -> list[str]:
    """``named`` and every package above it that is not above (or) the importer, when they are ``known``."""
    parts = named.split(".")
    mine = importer.split(".")
    out = [named] if named in known else []
    for n in range(1, len(parts)):
        parent = ".".join(parts[:n])
        if parent in known and mine[:n] != parts[:n]:
            out.append(parent)
    return out


def import_edges(known: dict[str, Path]) -> Edges:
    """Every import of every module in ``known`` as edges between modules of ``known``."""
    edges: Edges = {m: {} for m in known}
    for module, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for named in _named(module, path.name == "__init__.py", node, known):
                for target in _with_parents(module, named, known):
                    edges[module].setdefault(target, node.lineno)
    return edges


def cycles(edges: Edges) -> list[list[str]]:
    """One circle (``[a, b, ..., a]``) through each strongly connected group of modules, self-imports included."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the graphs are small, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
            if len(group) > 1 or v in edges[v]:
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_circle(group, edges) for group in groups]


def _circle(group: list[str], edges: Edges) -> list[str]:
    """A shortest circle from the group's first module back to it, staying inside the group."""
    start, inside = group[0], set(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v]):
                if w == start:
                    return [*paths[v], start]
                if w in inside and w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(group)  # a strongly connected group always closes


def _show(circle: list[str], edges: Edges) -> str:
    return " -> ".join(f"{a} (line {edges[a][b]})" for a, b in zip(circle, circle[1:])) + f" -> {circle[-1]}"


def _layer(module: str, package: str, layers: tuple[tuple[str, ...], ...]) -> int | None:
    name = module.removeprefix(package).removeprefix(".").split(".")[0]
    return next((i for i, units in enumerate(layers) if name in units), None)


def layer_breaks(edges: Edges, package: str, layers: tuple[tuple[str, ...], ...]) -> list[str]:
    """The imports inside ``package`` that point up the ``layers``, and its modules that are in no layer."""
    bad = []
    for module, targets in sorted(edges.items()):
        if module != package and not module.startswith(package + "."):
            continue
        mine = _layer(module, package, layers)
        if mine is None:
            bad.append(f"{module} is in no layer: add its name to LAYERS in {Path(__file__).name}")
            continue
        said = set()  # one line per import statement: the module it names, not also the packages above it
        for target, line in targets.items():
            inside = target == package or target.startswith(package + ".")  # a nested package too
            theirs = _layer(target, package, layers) if inside else None
            if theirs is not None and theirs > mine and line not in said:
                said.add(line)
                bad.append(f"{module} (line {line}) imports {target}, a layer above it")
    return bad


def test_no_import_circle_in_distckpt_or_launch():
    edges = import_edges(modules(ROOT, ("distckpt", "launch")))
    assert {"distckpt.apply.wrap", "distckpt.select.budget.program", "launch.build", "launch.config"} <= set(edges)
    found = cycles(edges)
    assert not found, "import circles (every import counts, lazy ones too):\n" + "\n".join(
        _show(c, edges) for c in found
    )


def test_distckpt_layers_point_down():
    edges = import_edges(modules(ROOT, ("distckpt",)))
    assert "distckpt.runtime.swap" in edges["distckpt.select.profile.recompute_passes"]  # resolution works on the tree
    bad = layer_breaks(edges, "distckpt", LAYERS)
    assert not bad, "imports against the layer order (select < apply < parallel < check < train):\n" + "\n".join(bad)


def test_select_sub_packages_point_down():
    """select/: the profiler knows nothing of the planner, the planner nothing of the policies."""
    edges = import_edges(modules(ROOT, ("distckpt",)))
    assert "distckpt.select.profile" in edges["distckpt.select.budget.planner"]  # through the package's __init__
    bad = layer_breaks(edges, "distckpt.select", SELECT_LAYERS)
    assert not bad, "imports against select/'s order (profile < candidates, blocks < budget < policies):\n" + "\n".join(
        bad
    )


def _package(root: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return modules(root, {name.split("/")[0] for name in files})


def test_checker_fails_on_planted_circles(tmp_path):
    known = _package(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.api import f\nfrom pkg.api2 import f2\n",
            "pkg/_compat.py": "",
            # from pkg import <submodule>: that submodule, not pkg/__init__.py: no circle
            "pkg/api.py": "from pkg import _compat\ndef f():\n    from pkg.core import g\n",
            # a lazy import closing a circle
            "pkg/core.py": "import pkg.helper\ndef g(): ...\n",
            "pkg/helper.py": "def h():\n    from pkg.core import g\n",
            # a name that pkg/__init__.py defines: the package itself, whose __init__ imports this module
            "pkg/api2.py": "from pkg import f\ndef f2(): ...\n",
            # importing pkg.sub.x from outside pkg/sub/ runs pkg/sub/__init__.py, which imports the loop
            "pkg/sub/__init__.py": "from pkg.sub.loop import run\n",
            "pkg/sub/loop.py": "import pkg.sub.x\nimport pkg.outer\ndef run(): ...\n",
            "pkg/sub/x.py": "",
            "pkg/outer.py": "import pkg.sub.x\n",
            # a script importing itself by name
            "pkg/script.py": "def main(): ...\nif __name__ == '__main__':\n    from pkg.script import main\n",
            # type-only imports count too
            "pkg/typed.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg.typed2 import T\nU = 1\n",
            "pkg/typed2.py": "from .typed import U\nT = U\n",  # relative, resolved
        },
    )
    edges = import_edges(known)
    assert "pkg._compat" in edges["pkg.api"] and "pkg" not in edges["pkg.api"]
    assert "pkg.sub" in edges["pkg.outer"] and "pkg.sub" not in edges["pkg.sub.loop"]  # own package: no edge
    assert set(edges["pkg.typed2"]) == {"pkg.typed"}
    assert sorted(cycles(edges)) == [
        ["pkg", "pkg.api2", "pkg"],
        ["pkg.core", "pkg.helper", "pkg.core"],
        ["pkg.outer", "pkg.sub", "pkg.sub.loop", "pkg.outer"],
        ["pkg.script", "pkg.script"],
        ["pkg.typed", "pkg.typed2", "pkg.typed"],
    ]
    assert _show(["pkg.core", "pkg.helper", "pkg.core"], edges) == (
        "pkg.core (line 1) -> pkg.helper (line 2) -> pkg.core"
    )


def test_checker_fails_on_planted_layer_breaks(tmp_path):
    known = _package(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.high.b import b\n",
            "pkg/base.py": "",
            "pkg/low/__init__.py": "",
            "pkg/low/a.py": "from pkg import base\ndef a():\n    from pkg.high import b\n",  # lazy, and upward
            "pkg/high/__init__.py": "",
            "pkg/high/b.py": "from pkg.low.a import a\nimport pkg.base\ndef b(): ...\n",
            "pkg/stray.py": "",
        },
    )
    layers = (("base",), ("low",), ("high",), ("",))
    assert layer_breaks(import_edges(known), "pkg", layers) == [
        "pkg.low.a (line 3) imports pkg.high.b, a layer above it",
        "pkg.stray is in no layer: add its name to LAYERS in test_import_graph.py",
    ]
    # The layers of a nested package (as SELECT_LAYERS for distckpt.select).
    nested = _package(
        tmp_path / "nested",
        {
            "top/__init__.py": "",
            "top/sub/__init__.py": "",
            "top/sub/deep/__init__.py": "from top.sub.up import f\n",  # the package's __init__ reaches up
            "top/sub/up.py": "def f(): ...\n",
        },
    )
    assert layer_breaks(import_edges(nested), "top.sub", (("deep",), ("up",), ("",))) == [
        "top.sub.deep (line 1) imports top.sub.up, a layer above it"
    ]
