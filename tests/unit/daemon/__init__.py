"""The tests of daemon/."""
