"""Which models are loaded.

model     one model: its parts per load, its state, its slots kept before an unload
registry  the models: which one a request names, holding it, the scheduler's task
schedule  the scheduler's decisions: which models to unload for another, which expired (pure)
memory    what a model takes: estimated before it loads, measured while loaded
layout    whether a model's llama-servers run with --swa-full
"""
