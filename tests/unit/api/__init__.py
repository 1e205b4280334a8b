"""The tests of api/."""
