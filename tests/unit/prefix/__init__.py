"""The tests of prefix/."""
