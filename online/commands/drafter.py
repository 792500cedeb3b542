"""`livedraft drafter init`: derive a small drafter from a target."""

from __future__ import annotations

import argparse

from online.config import load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("drafter", help="drafter tools")
    dsub = p.add_subparsers(dest="drafter_command", required=True)
    init = dsub.add_parser("init", help="derive a drafter from a target's first layers")
    init.add_argument("--from-target", required=True, help="target: directory, GGUF file or smollm2-135m")
    init.add_argument("--layers", type=int, required=True, help="how many of the target's first layers to keep")
    init.add_argument("--vocab-top", type=int, help="trim the LM head to the V most frequent tokens (VocabTrim)")
    init.add_argument("--vocab-text", help="text file whose token frequencies choose the kept vocabulary")
    init.add_argument("--out", required=True, help="output directory")
    init.set_defaults(func=init_drafter)


def init_drafter(args: argparse.Namespace) -> int:
    from runtime.derive import derive_drafter
    from runtime.loader import load_model

    cfg = load_config(args.config)
    target = load_model(args.from_target, cache_dir=cfg.models.cache_dir)
    out = derive_drafter(target, args.layers, args.out, vocab_top=args.vocab_top, text_file=args.vocab_text)
    print(out)
    return 0
