"""The tests of models/."""
