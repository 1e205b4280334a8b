"""The tests of repo/."""
