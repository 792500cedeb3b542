"""CLI subcommands, one module each (see online/cli.py)."""
