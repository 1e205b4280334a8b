"""The tests of observe/."""
