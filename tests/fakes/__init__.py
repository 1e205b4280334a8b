"""What the tests stand in for llama-server, the providers and a supervised child.

llama/                   one fake llama-server: a core (what it answers to a method, path and body, and
                         its slots) with an in-process adapter and a program adapter
fake_provider.py         a prefill provider, exec or worker (the state-file route)
fake_share_provider.py   a provider for the share route, and the state-file route it falls back to
share_meddler.py         supervisor.llama.share_worker with one fault injected
shared_store_writer.py   a host that dies half way through storing into a shared prefix store
fake_child.py            a supervised child with a health file and an exit on demand
fake_control.py          the one control file the programs here take their modes from, and their logs
"""
