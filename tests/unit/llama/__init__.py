"""The tests of llama/."""
