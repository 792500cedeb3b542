"""Registers the fixtures shared by tests/ and bench/tests/ (devkit/fixtures.py)."""

pytest_plugins = ["devkit.fixtures"]
