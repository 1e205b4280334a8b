"""onebit's chaos suite (docs/reliability.md), run from the checkout as ``python -m chaos`` behind
scripts/chaos; not part of the onebit wheel.

The layers, lowest first (tests/unit/repo/test_imports.py holds them): traffic.py (what is sent and the verdict
on what came back) and fuzz.py (the malformed requests hypothesis draws); rig.py (onebitd under
test and what it left behind); faults.py (what is done to it); one module per kind of scenario
(decoder.py, providers.py, clients.py, resources.py), which imports only those; cli.py, the command
line that lists them.  soak.py, the long run behind scripts/soak (``python -m chaos.soak``), sits
beside the scenarios: it runs onebitd as a process of its own and samples its resources for hours.
"""
