"""The tests of supervise/."""
