"""The tests of providers/."""
