"""``python -m chaos``: scripts/chaos's entry point (the command line: chaos/cli.py)."""

import sys

from chaos.cli import main

if __name__ == "__main__":
    sys.exit(main())
