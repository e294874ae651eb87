"""The commands in examples/*.py docstrings run as written (with fewer steps) on 2 ranks, inside the tests
that need that same 2-rank run anyway (the launcher's overrides on the pool's ranks: launchkit.train_on_ranks):

- examples/custom.py: tests/launch/test_custom.py::test_custom_example_on_2_ranks_matches_a_single_process
  (DDP against a single process);
- examples/tiny_pretrained.py: both commands in tests/launch/test_multitask.py's ``setup`` fixture (the
  pretrained directory, then the LoRA fine-tune, under DDP and FSDP2 against a single process).

Here: every example with a command is one of those, so a new example is not left untested."""

from __future__ import annotations

from pathlib import Path

from launchkit import ROOT, example_commands

RUN_BY = {"custom.py": "test_custom.py", "tiny_pretrained.py": "test_multitask.py"}


def test_every_example_command_is_run_by_a_launcher_test():
    examples = [p for p in sorted((ROOT / "examples").glob("*.py")) if '"""' in p.read_text()]
    assert {p.name for p in examples if example_commands(p.name)} == set(RUN_BY)
    for example, test in RUN_BY.items():
        assert f'example_commands("{example}")' in (Path(__file__).parent / test).read_text(), (example, test)
