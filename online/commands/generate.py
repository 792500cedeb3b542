"""`livedraft generate`: speculative generation over a prompts file, with acceptance stats."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from online.config import load_config
from online.loading import DRAFTER_KINDS_HELP, add_model_arguments
from runtime.adaptive import DraftLengthConfig
from runtime.errors import LivedraftError, RequestError
from runtime.stats import RequestStats

# torch/transformers are imported inside run(): every CLI invocation imports all
# command modules to build the parser, and must not pay for the models' stack.


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate completions for a prompts file")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="directory, GGUF file or smollm2-135m")
    p.add_argument("--drafter", help="drafter directory or models:/NAME@ALIAS (a model, eagle or crossvocab "
                                     "drafter; with --drafter-kind hybrid, its learned half)")
    p.add_argument("--drafter-kind", help=f"{DRAFTER_KINDS_HELP} (default: the kind of the --drafter directory, "
                                          "model without one)")
    p.add_argument("--prompts", required=True, help=".txt (one prompt per line) or .jsonl ({\"prompt\": ...})")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--k", type=int, default=4, help="fixed draft length (default 4)")
    mode.add_argument("--adaptive", action="store_true",
                      help="adaptive draft length: each step the k in 0..--k-max with the most expected tokens/s, "
                           "from measured draft and verify costs (runtime/adaptive.py)")
    p.add_argument("--k-max", type=int, default=8, help="upper bound on k in --adaptive mode")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="one JSON line per prompt and a final summary line")
    add_model_arguments(p)


def read_prompts(path: str) -> list[str]:
    f = Path(path)
    if f.is_dir():
        raise LivedraftError(f"prompts file {f} is a directory: give a .txt (one prompt per line) or .jsonl file")
    if not f.is_file():
        raise LivedraftError(f"prompts file {f} does not exist")
    if f.suffix == ".jsonl":
        prompts = []
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise LivedraftError(f"{f}:{n}: expected a JSON object with a \"prompt\" field") from None
    else:
        prompts = [line for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise LivedraftError(f"prompts file {f} has no prompts")
    return prompts


def encode(tokenizer: object, prompt: str, chat: bool) -> list[int]:
    if chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return tokenizer(prompt).input_ids


def run(args: argparse.Namespace) -> int:
    from online.loading import load_target, resolve_drafter
    from runtime.drafters.factory import DrafterConfig, build_drafter, drafter_kind
    from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine

    cfg = load_config(args.config)
    if args.k < 0 or args.k_max < 1:
        raise LivedraftError(f"draft lengths: --k must be >= 0 and --k-max >= 1, got {args.k} and {args.k_max}")
    prompts = read_prompts(args.prompts)
    target = load_target(args.target, cfg, args)
    if target.tokenizer is None:
        raise LivedraftError(f"target {args.target} has no tokenizer: generate needs one to encode prompts")
    if args.chat and not getattr(target.tokenizer, "chat_template", None):
        raise LivedraftError(f"target {args.target} has no chat template: drop --chat to encode prompts as plain text")
    path = resolve_drafter(args.drafter, cfg)
    kind = args.drafter_kind or (drafter_kind(path) if path else "model")
    drafter = build_drafter(DrafterConfig(kind=kind, path=path), target, cfg.models.cache_dir)
    length = DraftLengthConfig(k=args.k_max, adaptive=True) if args.adaptive else DraftLengthConfig(k=args.k)
    engine = SpeculativeEngine.for_model(target, drafter, EngineConfig(draft=length))
    params = SamplingParams(args.max_new_tokens, args.temperature, args.top_p, args.seed)
    all_stats: list[RequestStats] = []
    for prompt in prompts:
        try:
            res = engine.generate(encode(target.tokenizer, prompt, args.chat), params)
        except RequestError as e:
            print(f"skipped prompt {prompt[:40]!r}: {e}", file=sys.stderr)
            continue
        all_stats.append(res.stats)
        text = target.tokenizer.decode(res.output_ids, skip_special_tokens=True)
        if args.json:
            print(json.dumps({"prompt": prompt, "output_ids": res.output_ids, "text": text,
                              "stats": res.stats.to_dict()}))
        else:
            s = res.stats
            print(f"### {prompt}\n{text}\n--- {s.output_tokens} tokens, {s.tokens_per_s:.1f} tok/s, "
                  f"mean acceptance length {s.mean_acceptance_length:.2f}, acceptance rate {s.acceptance_rate:.2f}\n")
    total = RequestStats.total(all_stats)
    if args.json:
        print(json.dumps({"summary": total.to_dict()}))
    else:
        print(f"=== {total.requests} requests, drafter {drafter.version}: "
              + ", ".join(f"{k}={v}" for k, v in total.to_dict().items()))
    return 0 if all_stats else 1
