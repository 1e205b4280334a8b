"""The tests of admin/."""
