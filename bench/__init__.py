"""onebit's benchmarks (docs/benchmarks.md), run from the checkout as ``python -m bench`` behind
scripts/bench; not part of the onebit wheel.

The layers, lowest first (tests/unit/repo/test_imports.py holds them): plot.py (the pictures) and trace.py
(a stream's timeline); rig.py (onebitd as a benchmark runs it, the direct llama-server, the machine
line and its noise); workloads.py (what is sent and how it is timed); one module per benchmark,
which imports only those and never another benchmark; cli.py, the command line that lists them.
engines.py runs on its own (``python -m bench.engines``).
"""
