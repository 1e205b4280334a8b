"""The fakes the tests stand in for llama-server, the providers and a supervised child.

llama/            one fake llama-server: a core (what it answers to a method, path and body, and its
                  slots) with an in-process adapter and a subprocess adapter
"""
