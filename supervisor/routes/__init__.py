"""A request's route: the pure decision, the effects of the two hybrid routes, and the request's story.

    decision    Route, Step, the DEGRADE table, choose(): pure, table-tested
    capability  what a model's restores can do, proven at its load: whole, prefix, none
    prompt      a request's prompt read once (chat, text, tokens, unsupported), and its exact tokens
    prefill     a provider's prefill under a deadline, its claim checked: shared by both hybrid routes
    file        the file route: a provider writes a slot state file, the decoder restores it
    share       the share route: the decoder lends its KV region over fds, then adopts the cells
    stored      the prefix store in a request: the restore before the route, the save after
    plan        what is known before a slot is taken: the prompt's key and tokens, the provider
    completion  a completion request's steps: plan, slot, route, handoff, relay, verification
    handover    the walk down the hybrid routes, its outcomes kept in a Walk
    story       what each step returned, and the route line built from it once
    relay       a decoder's reply on its way to the client: whole, streamed, or an error
    usage       the usage a client is told: a provider's prefill is no cache hit
    rates       prefill and handoff costs fitted per child, sure only near measured sizes, priors elsewhere
    compute     whether a provider computes apart from the decoder (a device, CPU sets apart)
    fidelity    how far a handoff moves the decoder's next-token distribution

Handoffs return a frozen :class:`~supervisor.routes.decision.Outcome`, the relay a ``Relayed``;
``completion.Completions`` tells the request's ``story.Story`` each value, and the story alone builds
the route line from them.
"""
