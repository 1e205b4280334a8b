"""The tests of routes/."""
