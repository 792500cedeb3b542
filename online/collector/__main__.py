"""`python -m online.collector [--config F] [collect options]`: the collector as a process.

Same as `livedraft [--config F] collect [options]` (the options and `run` are that command's),
as a module entry point for supervisors and the kill/restart tests.
"""

import argparse
import logging
import sys

from online.commands.collect import add_arguments, run
from online.config import ConfigError
from runtime.errors import LivedraftError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m online.collector", description="stream → SQL store")
    p.add_argument("--config", help="TOML config file (default: $LIVEDRAFT_CONFIG)")
    add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except (LivedraftError, ConfigError) as e:
        print(f"collector: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
