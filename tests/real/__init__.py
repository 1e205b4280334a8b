"""The tests against the real llama-server and models (marked ``real``)."""
