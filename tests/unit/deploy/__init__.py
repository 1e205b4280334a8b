"""The tests of deploy/."""
