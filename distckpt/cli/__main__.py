"""``python -m distckpt.cli``: the ``distckpt`` command without its console script."""

import sys

from distckpt.cli import main

if __name__ == "__main__":
    sys.exit(main())
