"""``python -m bench``: scripts/bench's entry point (the benchmarks: bench/__init__.py)."""

import sys

from bench import main

sys.exit(main())
