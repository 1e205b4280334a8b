"""A request's route: the pure decision and the effects of the two hybrid routes.

    decision  Route, Reason, Step, the DEGRADE table, choose(): pure, table-tested
    prompt    the exact tokens the decoder will evaluate for a request
    prefill   a provider's prefill under a deadline, its claim checked: shared by both hybrid routes
    file      the file route: a provider writes a slot state file, the decoder restores it
    share     the share route: the decoder lends its KV region over fds, then adopts the cells

Handoffs return a frozen :class:`~supervisor.routes.decision.Outcome`; ``completion.Completions``
walks ``DEGRADE`` with them and is the only writer of the route line's route fields.
"""
