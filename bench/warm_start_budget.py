"""The main job's warm start within its time budget: trainer settings compared on the same answers.

`livedraft up` (and `bash scripts/run.sh`) warm-starts an EAGLE-3 head for `--warm-start-minutes`
on WARM_START_PROMPTS built-in prompts of every traffic domain but the demo's
(`online.trainer.bootstrap`). This bench answers those prompts once, as the warm start does, then
trains one new head per `--variant` for the same `--minutes` from the same answers, and replays
each teacher-forced at k = `--k`, greedy, on two held-out sets: the warm start's own last
WARM_START_HELDOUT answers (its domains) and `--demo-prompts` prompts of the demo's domain
(`--demo-domain`, distinct, the traffic the loop then learns; in no warm-start prompt). A variant is
`name=key:value,key:value` over TrainerConfig fields, applied on top of the warm start's settings
(`warm_start_config`); `base` (no change) always runs first. Runs alternate in order, `--repeats`
times, since a time budget's step count moves with the machine's load.

    python -m bench.warm_start_budget --variant lr2e-3=lr:2e-3 --variant bf16=mixed_precision:bf16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time

from bench.traffic import THREADS_HELP, start_run
from bench.train_eagle import replay_heldout
from online.config import ConfigError, TrainerConfig, _build
from online.traffic.prompts import DOMAINS, chat_prompts
from online.trainer import bootstrap
from online.trainer.warmstart import answer_prompts, warm_start
from runtime.loader import load_model


def parse_variant(text: str) -> tuple[str, dict]:
    """`name=key:value,...` -> (name, TrainerConfig overrides), keys checked and values typed as the
    config file's [trainer] section's are (`online.config`)."""
    name, _, body = text.partition("=")
    if not name or not body:
        raise SystemExit(f"--variant {text!r}: give name=key:value[,key:value]")
    raw = dict(item.partition(":")[::2] for item in body.split(","))
    try:
        typed = _build(TrainerConfig, raw, "trainer")
    except ConfigError as e:
        raise SystemExit(f"--variant {text!r}: {e}") from None
    return name, {key: getattr(typed, key) for key in raw}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--minutes", type=float, default=1.5, help="training time per head (up's default)")
    ap.add_argument("--variant", action="append", default=[], help="name=key:value[,key:value] (repeatable)")
    ap.add_argument("--demo-domain", default="stories", choices=sorted(DOMAINS))
    ap.add_argument("--demo-prompts", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2, help=THREADS_HELP)
    ap.add_argument("--out", default="bench/results/warm-start-budget")
    args = ap.parse_args()
    variants = [("base", {})] + [parse_variant(v) for v in args.variant]
    out, work = start_run(args)
    target = load_model(args.target)

    domains = [d for d in sorted(DOMAINS) if d != args.demo_domain]
    pool = DOMAINS[args.demo_domain]
    demo = chat_prompts(target.tokenizer, random.Random(12345).sample(pool, min(args.demo_prompts, len(pool))))
    t0 = time.perf_counter()
    train, heldout = bootstrap.warm_start_answers(target, domains)  # as `up` makes them
    demo_traces = answer_prompts(target, [target.tokenizer(t).input_ids for t in demo], bootstrap.WARM_START_TOKENS)
    print(f"answers: {len(train) + len(heldout) + len(demo_traces)} in {time.perf_counter() - t0:.0f}s", flush=True)

    rows = []
    for rep in range(args.repeats):
        for name, overrides in variants:
            cfg = dataclasses.replace(bootstrap.warm_start_config(args.minutes), **overrides)
            head_dir = work / f"{name}-{rep}"
            res = warm_start(target, train, heldout, head_dir, cfg, eval_every=0, version=name)
            row = {"variant": name, "repeat": rep, "steps": res.steps, "train_s": round(res.train_seconds, 1),
                   "own": replay_heldout(target, head_dir, heldout, args.k)["mean_acceptance_length"],
                   "demo": replay_heldout(target, head_dir, demo_traces, args.k)["mean_acceptance_length"]}
            rows.append(row)
            print(json.dumps(row), flush=True)

    lines = [f"warm start of {args.minutes:g} min, {len(train)} answers, k = {args.k}; held-out MAL on its own "
             f"domains ({len(heldout)}) and on {args.demo_domain} ({len(demo_traces)})", "",
             "| variant | settings | steps | MAL own domains | MAL demo domain |", "|---|---|---|---|---|"]
    for name, overrides in variants:
        mine = [r for r in rows if r["variant"] == name]
        settings = ", ".join(f"{k}={v}" for k, v in overrides.items()) or "up's warm start"
        steps = " / ".join(str(r["steps"]) for r in mine)
        own, demo_mal = (" / ".join(f"{r[key]:.3f}" for r in mine) for key in ("own", "demo"))
        if len(mine) > 1:
            demo_mal += f" (median {statistics.median(r['demo'] for r in mine):.3f})"
        lines.append(f"| {name} | {settings} | {steps} | {own} | {demo_mal} |")
    table = "\n".join(lines)
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    (out / "table.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
