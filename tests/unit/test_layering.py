"""Import direction: the library (distckpt/) never imports the launcher or its config/logging stack, and the
tests never import the benchmarks.

Every import statement counts, including lazy ones inside functions, so a library module cannot
reach ``launch/`` (or Hydra, OmegaConf, wandb, TensorBoard) on any code path.
"""

from __future__ import annotations

import ast
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[2] / "distckpt"
FORBIDDEN = ("launch", "hydra", "omegaconf", "wandb", "tensorboard")


def _imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import in ``tree``; relative imports stay inside distckpt."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _forbidden(module: str) -> bool:
    parts = module.split(".")
    # torch.utils.tensorboard needs the tensorboard package too.
    return parts[0] in FORBIDDEN or "tensorboard" in parts


def test_library_does_not_import_the_launcher():
    files = sorted(LIBRARY.rglob("*.py"))
    assert files, LIBRARY
    bad = [
        f"{path.relative_to(LIBRARY.parent)}:{line} imports {name}"
        for path in files
        for line, name in _imported(ast.parse(path.read_text(), filename=str(path)))
        if _forbidden(name)
    ]
    assert not bad, "the library must not import the launcher's stack:\n" + "\n".join(bad)


def test_scanner_sees_lazy_imports():
    tree = ast.parse(
        "def f():\n    import hydra.core\n    from launch.check import compose\n"
        "    from torch.utils.tensorboard import SummaryWriter\n    import torch.nn\n"
    )
    assert [_forbidden(name) for _, name in _imported(tree)] == [True, True, True, False]


def test_tests_do_not_import_the_benchmarks():
    # The tests' fixtures (models, measurements) live in tests/ and the benchmarks import them, not the other way:
    # a benchmark may change its tables without touching what a test asserts.
    tests = LIBRARY.parent / "tests"
    bad = [
        f"{path.relative_to(LIBRARY.parent)}:{line} imports {name}"
        for path in sorted(tests.rglob("*.py"))
        for line, name in _imported(ast.parse(path.read_text(), filename=str(path)))
        if name.split(".")[0] == "benchmarks"
    ]
    assert not bad, "tests/ must not import benchmarks/ (move the fixture into tests/):\n" + "\n".join(bad)
