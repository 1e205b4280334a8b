"""The tests of http/."""
