"""``python -m chaos``: scripts/chaos's entry point (the scenarios: chaos/__init__.py)."""

import sys

from chaos import main

sys.exit(main())
