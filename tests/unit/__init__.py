"""The tests without the real llama-server, by the layer of supervisor/ (or the repository) they hold."""
