"""`livedraft config show`: the effective configuration (file + environment);
`livedraft config docs`: the configuration reference (docs/configuration.md), from the code."""

from __future__ import annotations

import argparse

from online.config import load_config, to_toml


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="show the effective configuration")
    csub = p.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser("show", help="print the effective config as TOML")
    show.set_defaults(func=show_config)
    docs = csub.add_parser("docs", help="print the configuration reference (Markdown) generated from the code")
    docs.set_defaults(func=config_docs)


def show_config(args: argparse.Namespace) -> int:
    print(to_toml(load_config(args.config)), end="")
    return 0


def config_docs(args: argparse.Namespace) -> int:
    from online.config_docs import reference

    print(reference(), end="")
    return 0
