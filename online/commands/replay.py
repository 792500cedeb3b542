"""`livedraft replay`: score drafters on logged traffic, side by side.

Parses the command line and calls online/replay/compare.py. Greedy traces are scored
teacher-forced (online/replay/engine.py: exact, no target needed); sampled
traces are skipped there and counted. With `--target` every trace is also re-executed
through the real engine, which adds wall-clock tokens/s and a measured speedup over the
target alone.
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime

from online.config import load_config
from online.loading import add_model_arguments
from online.replay.compare import ASSUMED_COST_RATIO, drafter_specs, load_traffic, plot, render, score
from runtime.adaptive import DraftLengthConfig
from runtime.drafter_kinds import KINDS, MODEL_FREE
from runtime.errors import LivedraftError

# what --drafter-kind takes; a learned drafter's own kind (eagle, crossvocab) is read from its directory
KINDS_HELP = " | ".join(k for k, v in KINDS.items() if not v.learned or k == "model")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="score drafters on logged traffic (teacher-forced; --target re-executes)")
    p.add_argument("--traffic", required=True,
                   help="a store URL (sqlite:///path.db, postgresql+psycopg://...) or a .jsonl export")
    add_model_arguments(p)
    p.add_argument("--limit", type=int, help="the most recent N matching traces")
    p.add_argument("--since", help="created at or after (epoch seconds or ISO 8601, UTC if no zone)")
    p.add_argument("--until", help="created before (epoch seconds or ISO 8601)")
    p.add_argument("--tag", help="only traces with this domain/tenant tag")
    p.add_argument("--drafter", action="append", default=[], metavar="D",
                   help="drafter to score (repeat to compare): a model, eagle or crossvocab directory (its kind "
                        f"is detected), a GGUF/name, or a model-free kind ({', '.join(MODEL_FREE)})")
    p.add_argument("--drafter-kind", default="model", help=f"kind of every --drafter: {KINDS_HELP} (default model)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--k", type=int, default=4, help="fixed draft length (default 4)")
    mode.add_argument("--adaptive", action="store_true",
                      help="adaptive draft length as served, deciding on --cost-ratio and a verify cost of "
                           "+10%% per position (replay's own timings say nothing about serving)")
    p.add_argument("--k-max", type=int, default=8, help="upper bound on k in --adaptive mode")
    p.add_argument("--target", help="re-execute the requests through the engine with this target (wall-clock tokens/s)")
    p.add_argument("--cost-ratio", type=float,
                   help="cost of one draft token / one verify forward for model drafters (default: measured "
                        f"with --target, else from the traces' timings, else {ASSUMED_COST_RATIO}); model-free kinds "
                        "cost 0")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--plot", metavar="PNG", help="draw acceptance per position and per tag to this file")
    p.set_defaults(func=run)


# --- traffic -----------------------------------------------------------------------------


def parse_time(value: str | None, flag: str) -> float | None:
    """Epoch seconds or an ISO 8601 timestamp (naive = UTC); raises LivedraftError otherwise."""
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        dt = datetime.fromisoformat(value)
    except ValueError:
        raise LivedraftError(f"{flag} {value!r} is neither epoch seconds nor an ISO 8601 time "
                             "(2026-11-23T10:00)") from None
    return (dt if dt.tzinfo else dt.replace(tzinfo=UTC)).timestamp()


def run(args: argparse.Namespace) -> int:
    from online.loading import load_target, resolve_drafter

    cfg = load_config(args.config)
    specs = drafter_specs([resolve_drafter(d, cfg) for d in args.drafter or []], args.drafter_kind)
    if args.k < 1 or args.k_max < 1:
        raise LivedraftError("--k and --k-max must be >= 1")
    if args.cost_ratio is not None and args.cost_ratio < 0:
        raise LivedraftError(f"--cost-ratio must be >= 0, got {args.cost_ratio}")
    traces = load_traffic(args.traffic, limit=args.limit, since=parse_time(args.since, "--since"),
                          until=parse_time(args.until, "--until"), tag=args.tag)
    filters = {k: v for k, v in (("limit", args.limit), ("since", args.since), ("until", args.until),
                                 ("tag", args.tag)) if v is not None}
    if not traces:
        raise LivedraftError(f"no traces in {args.traffic}" + (f" matching {filters}" if filters else ""))
    greedy = sum(t.greedy for t in traces)
    if not greedy and not args.target:
        raise LivedraftError(f"all {len(traces)} traces are sampled (temperature > 0): teacher-forced replay scores "
                             "greedy traffic only; pass --target to re-execute them")
    length = DraftLengthConfig(k=args.k_max, adaptive=True) if args.adaptive else DraftLengthConfig(k=args.k)
    target = load_target(args.target, cfg, args) if args.target else None
    runs = score(traces, specs, length, target, args.cost_ratio, cfg.models.cache_dir)
    summary = {"source": args.traffic, "filters": filters, "traces": len(traces), "greedy": greedy,
               "skipped_sampled": len(traces) - greedy}
    if args.plot:
        plot(runs, args.plot)
    if args.json:
        print(json.dumps({**summary, "drafters": [r.to_dict() for r in runs]}))
    else:
        print(render(runs, summary))
        if args.plot:
            print(f"\nplot written to {args.plot}")
    return 0
