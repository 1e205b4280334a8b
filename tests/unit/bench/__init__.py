"""The tests of bench/."""
