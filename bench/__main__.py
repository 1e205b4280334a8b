"""``python -m bench``: scripts/bench's entry point (the command line: bench/cli.py)."""

import sys

from bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
