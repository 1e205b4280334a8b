"""onebit: a trio supervisor for local LLM serving across a prefill device and a decoder."""

__version__ = "0.1.0"
