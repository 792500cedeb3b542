"""`livedraft traffic`: send prompts — built-in ones of a domain, or your own file — to a server at a
rate; watch acceptance and tokens/s rise."""

from __future__ import annotations

import argparse
import os
import sys

from online.traffic.prompts import DOMAINS, prompts_for
from runtime.errors import LivedraftError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("traffic", help="send prompts (built-in domains or a file) to a livedraft server")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--domain", choices=sorted(DOMAINS), help="built-in prompts of this domain (default: stories)")
    src.add_argument("--prompts", help="your own prompts: .txt (one per line) or .jsonl ({\"prompt\": ...}), "
                                       "sent in order, cycling when --requests asks for more")
    p.add_argument("--rate", type=float, default=1.0,
                   help="requests per second (<= 0: as fast as --concurrency allows)")
    p.add_argument("--requests", type=int, default=100, help="how many requests to send")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (replay and the trainer's gate use greedy traffic)")
    p.add_argument("--tag", help="domain/tenant tag recorded with each trace (default: the domain; none for --prompts)")
    p.add_argument("--api-key", help="sent as `Authorization: Bearer KEY` (default: env LIVEDRAFT_API_KEY)")
    p.add_argument("--baseline-every", type=int, default=0,
                   help="every N-th request is served by the target alone (tokens/s baseline in the same run)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at most")
    p.add_argument("--seed", type=int, default=0, help="prompt sampling seed")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in a ChatML user turn (instruct models "
                                                      "such as SmolLM2-135M-Instruct)")
    p.add_argument("--report-every", type=float, default=5.0, help="seconds between live lines")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from online.traffic.generator import chat_wrap, run_traffic

    if args.requests < 1:
        raise LivedraftError(f"--requests must be >= 1, got {args.requests}")
    if args.prompts:
        from online.commands.generate import read_prompts

        own = read_prompts(args.prompts)
        prompts, what, tag = [own[i % len(own)] for i in range(args.requests)], f"prompts from {args.prompts}", args.tag
    else:
        domain = args.domain or "stories"
        prompts, what, tag = prompts_for(domain, args.requests, seed=args.seed), domain, args.tag or domain
    if args.chat:
        prompts = chat_wrap(prompts)
    print(f"sending {args.requests} {what} requests to {args.url} at "
          f"{'max rate' if args.rate <= 0 else f'{args.rate:g}/s'} ({args.max_tokens} tokens, "
          f"temperature {args.temperature:g})", flush=True)
    report = run_traffic(args.url, prompts, rate=args.rate, max_tokens=args.max_tokens,
                         temperature=args.temperature, tag=tag, concurrency=args.concurrency,
                         report_every_s=args.report_every, on_line=lambda line: print(line, flush=True),
                         baseline_every=args.baseline_every,
                         api_key=args.api_key or os.environ.get("LIVEDRAFT_API_KEY"))
    for e in report.errors:
        print(f"error: {e}", file=sys.stderr)
    if not report.completed:
        raise LivedraftError(f"no request succeeded ({report.failed} failed): is a server running at {args.url}?")
    print(f"done: {len(report.completed)} answered, {report.failed} failed in {report.seconds:.0f}s; drafter "
          f"versions served: {' -> '.join(report.versions())}", flush=True)
    return 0 if report.failed == 0 else 1
