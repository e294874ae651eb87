"""The docs' integration examples as the tests run them: the Python block of a docs/integrations.md section, and that
block run as a user runs it, `torchrun --standalone --nproc_per_node=2 example.py` on CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def docs_example(section: str) -> str:
    """The first ```python block under ``## {section}`` of docs/integrations.md."""
    text = (ROOT / "docs" / "integrations.md").read_text()
    body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", body, re.S).group(1)


def run_under_torchrun(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """``code`` saved as example.py in ``tmp_path`` and run there by torchrun with 2 CPU processes."""
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-4000:])
    return run
