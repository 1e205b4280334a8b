"""What the daemon reports.

routestats  what the route lines add up to, and the live feed of ``onebitctl watch``
status      the daemon's statistics, a frozen value the ``status`` verb sends
metrics     ``/metrics`` in Prometheus text format
logs        log set-up (logfmt or JSON; journal-aware)
"""
