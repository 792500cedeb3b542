"""`livedraft` console script: one subcommand per module in online/commands/."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import pkgutil
import sys
import threading

import online.commands

# Every module in online/commands/ defines `register(subparsers)`, which adds its
# parser(s) with `set_defaults(func=...)`; `func(args) -> int` is the exit status.
# Modules are discovered, so adding a command is adding a file.
COMMANDS = sorted(m.name for m in pkgutil.iter_modules(online.commands.__path__) if not m.name.startswith("_"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="livedraft",
                                     description="Speculative decoding that learns from live traffic.")
    parser.add_argument("--config", help="TOML config file (default: $LIVEDRAFT_CONFIG)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"online.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # transformers draws a "Loading weights" bar on every (re)load; drafters reload on each swap
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from online.commands.daemon import exit_on_termination
    from online.config import ConfigError
    from runtime.errors import LivedraftError

    restore = exit_on_termination() if threading.current_thread() is threading.main_thread() else None
    try:
        return int(args.func(args) or 0)
    except (LivedraftError, ConfigError) as e:
        print(f"livedraft {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        if restore is not None:
            restore()


if __name__ == "__main__":
    sys.exit(main())
