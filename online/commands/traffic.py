"""`livedraft traffic`: send prompts of one domain to a server at a rate; watch acceptance rise."""

from __future__ import annotations

import argparse
import sys

from online.prompts import DOMAINS, prompts_for
from runtime.errors import LivedraftError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("traffic", help="send built-in prompts of a domain to a livedraft server")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--domain", default="stories", choices=sorted(DOMAINS))
    p.add_argument("--rate", type=float, default=1.0, help="requests per second (<= 0: as fast as --concurrency allows)")
    p.add_argument("--requests", type=int, default=100, help="how many requests to send")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (replay and the trainer's gate use greedy traffic)")
    p.add_argument("--tag", help="domain/tenant tag recorded with each trace (default: the domain)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at most")
    p.add_argument("--seed", type=int, default=0, help="prompt sampling seed")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in a ChatML user turn (instruct models "
                                                      "such as SmolLM2-135M-Instruct)")
    p.add_argument("--report-every", type=float, default=5.0, help="seconds between live lines")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from online.traffic import chat_wrap, run_traffic

    if args.requests < 1:
        raise LivedraftError(f"--requests must be >= 1, got {args.requests}")
    prompts = prompts_for(args.domain, args.requests, seed=args.seed)
    if args.chat:
        prompts = chat_wrap(prompts)
    print(f"sending {args.requests} {args.domain} requests to {args.url} at "
          f"{'max rate' if args.rate <= 0 else f'{args.rate:g}/s'} ({args.max_tokens} tokens, "
          f"temperature {args.temperature:g})", flush=True)
    report = run_traffic(args.url, prompts, rate=args.rate, max_tokens=args.max_tokens,
                         temperature=args.temperature, tag=args.tag or args.domain,
                         concurrency=args.concurrency, report_every_s=args.report_every,
                         on_line=lambda line: print(line, flush=True))
    for e in report.errors:
        print(f"error: {e}", file=sys.stderr)
    if not report.completed:
        raise LivedraftError(f"no request succeeded ({report.failed} failed): is a server running at {args.url}?")
    print(f"done: {len(report.completed)} answered, {report.failed} failed in {report.seconds:.0f}s; drafter "
          f"versions served: {' -> '.join(report.versions())}", flush=True)
    return 0 if report.failed == 0 else 1
