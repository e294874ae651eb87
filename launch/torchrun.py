"""torchrun that exits with the workers' own code: ``python -m launch.torchrun [torchrun args] launch/train.py ...``.

Plain ``torchrun`` turns any worker failure into exit code 1 and a ``ChildFailedError`` report, even
when the workers already said what is wrong in one line (a config or resume error: code 2; a run
stopped by a non-finite loss: code 3; a hang distckpt's watchdog diagnosed: code 4). This runs torchrun's own
launcher (``torch.distributed.run``, same arguments) and maps a failure back: the exit code of the first worker that
failed, and torchrun's report only for a code the workers did not explain themselves (a crash). ``make train`` uses it.
"""

from __future__ import annotations

import logging
import re
import sys

# The codes launch/train.py exits with after printing its own short message on rank 0 (defined here, the
# module with no heavy imports, and imported by launch/train.py and launch/check.py).
EXIT_CONFIG = 2  # a config or resume error
EXIT_NONFINITE = 3  # a non-finite loss stopped the run (trainer.on_nonfinite)
EXIT_HANG = (
    4  # distckpt's hang watchdog ended the run after logging where each rank waited (distckpt.parallel.watchdog)
)
EXPLAINED = {EXIT_CONFIG, EXIT_NONFINITE, EXIT_HANG}


class _DropExplainedFailures(logging.Filter):
    """Drops the agent's "failed (exitcode: 2) local_rank: 0 ..." line when the worker explained the code,
    and its "Sending process N closing signal SIGTERM" to the workers left after a first failure (a crash
    still gets torchrun's full report from :func:`main`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        m = re.match(r"failed \(exitcode: (-?\d+)\)", msg)
        return not ((m and int(m.group(1)) in EXPLAINED) or re.match(r"Sending process \d+ closing signal", msg))


def main(argv: list[str]) -> int:
    """Run torchrun with ``argv``; return the code to exit with (0, or the first failed worker's)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_DropExplainedFailures())
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 1  # < 0: killed by a signal
        if code not in EXPLAINED:
            print(e.format_msg(), file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
