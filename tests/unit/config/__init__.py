"""The tests of config/."""
