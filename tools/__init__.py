"""The repository's own tools, run from the checkout and not part of the onebit wheel:
gguf_set_int.py sets one integer of a GGUF's metadata in place, for scripts/tiny-models.
"""
