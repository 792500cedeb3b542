"""`livedraft demo`: speculative generation on SmolLM2-135M with a drafter derived from it."""

from __future__ import annotations

import argparse
from pathlib import Path

from online.commands import generate
from online.config import load_config
from online.loading import add_model_arguments

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "prompts.txt"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="generate with SmolLM2-135M and a derived drafter, print acceptance stats")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--layers", type=int, default=4, help="layers of the derived drafter")
    p.add_argument("--prompts", default=str(EXAMPLES))
    p.add_argument("--max-new-tokens", type=int, default=48)
    add_model_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from online.loading import load_target
    from online.trainer.bootstrap import initial_drafter_dir

    cfg = load_config(args.config)
    drafter_dir = initial_drafter_dir(cfg, args.target, args.layers,
                                      lambda: load_target(args.target, cfg, args))
    for kind, extra in (("model", ["--adaptive"]), ("lookup", ["--k", "4"])):
        print(f"\n======== drafter: {kind} {' '.join(extra)} ========\n", flush=True)
        argv = ["--target", args.target, "--drafter", str(drafter_dir), "--drafter-kind", kind,
                "--prompts", args.prompts, "--max-new-tokens", str(args.max_new_tokens), "--chat", *extra]
        parser = argparse.ArgumentParser(prog="livedraft demo")
        generate.add_arguments(parser)
        ns = parser.parse_args(argv)
        ns.config = args.config
        generate.run(ns)
    return 0
