"""What the adaptation bench's traffic can teach a drafter at most: two ceilings for its segments.

`bench/bench_adaptation.py --kind eagle` serves 40 requests of a domain, then shifts. How much could
any learner gain from so little traffic? Two measurements on the same requests, at the bench's
fixed k, greedy, against the bench's frozen initial head (same cache, same traffic):

(1) verbatim memory: a suffix drafter (SuffixDecoding) whose global tree holds every earlier
    request's output, written through when it ends (no tags: it does not know the domain), against
    the same drafter with only the request's own prompt and output. What remembering all earlier
    traffic exactly adds, for n-gram statistics that recur across requests;
(2) in-domain data scaling: the initial head distilled offline (the daemon's eagle trainer, the
    bench's settings) on n requests of one domain -- other prompts of the same pool, none of the
    bench's -- for `--epochs` passes, then scored on the bench's requests of that domain. How much
    traffic of one domain an acceptance-rate gain needs, with the head learning all of it in advance.

    nice -n 5 python -m bench.adaptation_ceiling --threads 2    # ~25 min here
    python -m bench.adaptation_ceiling --scale-domains stories --sizes 40,120
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import time
from pathlib import Path

from bench.adaptation_eagle import as_trace, initial_head, per_request, replay_head
from bench.bench_adaptation import load_traffic, summary
from bench.traffic import (
    THREADS_HELP,
    Request,
    cached_requests,
    chat_ids,
    greedy_traffic,
    prompt_pool,
    start_run,
)
from online.config import TrainerConfig
from online.replay.engine import replay_traces
from online.trainer.eagle import distill_eagle
from online.trainer.round import target_passes
from runtime.adaptive import DraftLengthConfig
from runtime.drafters.eagle import EagleConfig
from runtime.drafters.suffix import SuffixDrafter
from runtime.loader import load_model

log = logging.getLogger("adaptation_ceiling")
POOL_SIZES = {"stories": 400, "code": 240, "instructions": 180}


def training_sizes(sizes: list[int], available: int) -> list[int]:
    """The requested training-set sizes that the pool can supply with distinct prompts, plus the
    largest it can when some asked for more (ValueError when none is positive)."""
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--sizes must be positive request counts, got {sizes}")
    keep = sorted({n for n in sizes if n <= available})
    if max(sizes) > available and available not in keep:
        log.warning("the pool has %d prompts besides the bench's: training on %d instead of %d",
                    available, available, max(sizes))
        keep.append(available)
    return keep


def steps_for(n: int, epochs: float, batch_size: int) -> int:
    """Optimizer steps for `epochs` passes over `n` traces at `batch_size` traces a step."""
    return max(1, math.ceil(n * epochs / batch_size))


def domain_traffic(target, domain: str, n: int, args, cache: Path) -> list[Request]:
    """The target's greedy answers to `n` prompts of `domain` that the bench does not serve (the
    pool's prompts after its first `per_domain`, in the bench's order), cached."""
    key = {"target": target.model_id, "domain": domain, "n": n, "skip": args.per_domain,
           "max_new_tokens": args.max_new_tokens, "seed": args.seed, "topk": 8}

    def answer() -> list[Request]:
        prompts = prompt_pool(domain, args.per_domain + n, seed=args.seed)[args.per_domain :]
        t0 = time.perf_counter()
        out = greedy_traffic(target, [chat_ids(target, p) for p in prompts], args.max_new_tokens, tag=domain)
        log.info("target answered %d more %s prompts in %.0fs", n, domain, time.perf_counter() - t0)
        return out

    return cached_requests(cache, key, answer)


def verbatim_memory(traffic: list[Request], domains: list[str], k: int, vocab: int) -> dict:
    """Per domain segment: a suffix drafter's MAL with and without the outputs of all earlier requests."""
    logged = [dataclasses.replace(as_trace(i, r), tag=None) for i, r in enumerate(traffic)]
    out = {}
    for write_through in (False, True):
        rep = replay_traces(logged, SuffixDrafter(write_through=write_through), length=DraftLengthConfig(k=k),
                            vocab_size=vocab, keep_traces=True)
        stats = per_request(rep.traces)
        for d in domains:
            idx = [i for i, r in enumerate(traffic) if r.tag == d]
            key = "earlier_outputs" if write_through else "own_request_only"
            out.setdefault(d, {})[key] = summary([stats[i] for i in idx])["mean_acceptance_length"]
    return out


def score(path: Path, version: str, target, traces: list, passes: dict, k: int) -> dict:
    """The eagle head at `path` replayed at fixed `k` over `traces`, with the target's features from `passes`."""
    return summary(per_request(replay_head(path, version, target, traces, passes, k).traces))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--domains", default="stories,code,instructions", help="the adaptation bench's traffic")
    ap.add_argument("--scale-domains", default="stories,code", help="domains of the data-scaling part")
    ap.add_argument("--sizes", default="40,120,360", help="in-domain training requests, comma-separated")
    ap.add_argument("--epochs", type=float, default=10.0, help="passes over the training requests")
    ap.add_argument("--per-domain", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--vocab-refresh", type=int, default=TrainerConfig.vocab_refresh)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init-minutes", type=float, default=5.0, help="the adaptation bench's initial head")
    ap.add_argument("--init-requests", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1, help=THREADS_HELP)
    ap.add_argument("--out", default="bench/results/adaptation-ceiling")
    args = ap.parse_args()
    try:
        sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--sizes takes comma-separated integers, got {args.sizes!r}")
    domains, scale = args.domains.split(","), [d for d in args.scale_domains.split(",") if d]
    if unknown := [d for d in scale if d not in domains or d not in POOL_SIZES]:
        ap.error(f"--scale-domains {unknown}: each must be one of the bench's --domains {domains} "
                 f"with a prompt pool ({', '.join(POOL_SIZES)})")
    if any(POOL_SIZES[d] <= args.per_domain for d in scale):
        ap.error(f"--per-domain {args.per_domain} leaves no other prompts of {scale} to train on")
    try:
        plan = {d: training_sizes(sizes, POOL_SIZES[d] - args.per_domain) for d in scale}
    except ValueError as e:
        ap.error(str(e))
    out, work = start_run(args)
    t_start = time.perf_counter()
    target = load_model(args.target)
    traffic = load_traffic(target, args, out.parent / "adaptation-eagle_traffic.json")
    init = initial_head(args, target, out.parent)
    result = {"config": vars(args), "init": str(init),
              "verbatim_memory": verbatim_memory(traffic, domains, args.k, target.vocab_size), "scaling": {}}
    aux = EagleConfig.read(init).aux_layers
    for d, ns in plan.items():
        extra = domain_traffic(target, d, max(ns), args, out.parent / f"{out.name}_{d}_traffic.json")
        bench = [as_trace(i, r) for i, r in enumerate(traffic) if r.tag == d]
        train = [as_trace(len(traffic) + i, r) for i, r in enumerate(extra)]
        passes = target_passes(target, aux, bench + train)
        rows = result["scaling"][d] = {"frozen": score(init, "initial", target, bench, passes, args.k)}
        for n in ns:
            cfg = TrainerConfig(steps=steps_for(n, args.epochs, args.batch_size), batch_size=args.batch_size,
                                lr=args.lr, ce_weight=0.2, seed=args.seed, warmup_steps=2,
                                vocab_refresh=args.vocab_refresh)
            t0 = time.perf_counter()
            distill_eagle(init, train[:n], work / f"{d}-{n}", cfg, target, passes=passes, version=f"{d}-{n}")
            row = score(work / f"{d}-{n}", f"{d}-{n}", target, bench, passes, args.k)
            row.update(steps=cfg.steps, train_s=round(time.perf_counter() - t0, 1),
                       gain=round(row["acceptance_rate"] - rows["frozen"]["acceptance_rate"], 3))
            rows[str(n)] = row
            log.info("%s, %d requests: %s", d, n, row)
            Path(f"{out}.json").write_text(json.dumps(result, indent=2))
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    Path(f"{out}.json").write_text(json.dumps(result, indent=2))
    print_tables(result, domains)


def print_tables(result: dict, domains: list[str]) -> None:
    vm = result["verbatim_memory"]
    print("\n| domain | suffix drafter, own request only: MAL | + every earlier request's output: MAL | added |")
    print("|---|---|---|---|")
    for d in domains:
        a, b = vm[d]["own_request_only"], vm[d]["earlier_outputs"]
        print(f"| {d} | {a} | {b} | {b - a:+.3f} |")
    for d, rows in result["scaling"].items():
        f = rows["frozen"]
        print(f"\n{d}: frozen initial head MAL {f['mean_acceptance_length']}, acc. rate {f['acceptance_rate']}")
        print("\n| in-domain requests trained on | steps | MAL | acc. rate | gain (acc. rate) | first-token acc. |")
        print("|---|---|---|---|---|---|")
        for n, r in rows.items():
            if n != "frozen":
                print(f"| {n} | {r['steps']} | {r['mean_acceptance_length']} | {r['acceptance_rate']} | "
                      f"{r['gain']:+} | {r['first_token_acceptance']} |")


if __name__ == "__main__":
    main()
