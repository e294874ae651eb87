"""The benchmarks (``python -m benchmarks.<name>`` from the checkout's root).

They measure the tests' own fixtures with the tests' own measurements (tests/models.py, peaks.py, zoo.py, ...),
so a table and the test that bounds it cannot drift apart. Those modules import one another by their bare
names, as pytest puts tests/ on the path (pyproject's ``pythonpath``); a benchmark is not run by pytest, so the
package puts tests/ there itself.
"""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent.parent / "tests")
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
