"""Hybrid drafting benchmark: SmolLM2-135M-Instruct on a repetitive and an open-ended workload.

Rows (greedy, same prompts, our engine): no drafter; the model drafter (derived from the
target's first layers, runtime.derive); the suffix drafter (own prompt/output tree + the global
cache of earlier outputs); the hybrid (suffix when its score >= threshold, else the model), at
fixed k and with the adaptive rule (`serve`'s default: the suffix cache's draft weighed as an
offer, the model by its own cost).
The global caches start empty and learn from every finished request, as a replica tailing the
traffic log would (here the output is added directly instead of going through the stream).
For each prompt all rows run back to back, so machine drift hits them alike.

Workloads (chat template, max_new_tokens 64):
  repetitive  - interleaved: JSON extraction of a person's facts from a sentence (one template,
                varying names/ages/cities), adding type hints to a small function (varying names),
                and a multi-turn agent loop whose prompt carries the earlier turns;
  open-ended  - distinct questions and writing tasks with no shared template.

    nice -n 10 python bench/bench_hybrid.py --requests 24 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path

import torch

from online.commands.generate import encode
from runtime.adaptive import DraftLengthConfig
from runtime.derive import derive_drafter
from runtime.drafters.factory import load_model_drafter
from runtime.drafters.hybrid import HybridDrafter
from runtime.drafters.none import NoDrafter
from runtime.drafters.suffix import SuffixDrafter
from runtime.drafters.suffix_tree import SuffixCache
from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine
from runtime.loader import load_model
from runtime.stats import RequestStats

NAMES = ["Alice", "Bob", "Carla", "Deepak", "Eve", "Farid", "Grace", "Hiro", "Ines", "Jonas"]
CITIES = ["Paris", "Rome", "Lima", "Oslo", "Cairo", "Seoul", "Quito", "Dublin"]
FUNCS = [("filter_big", "size"), ("pick_recent", "age"), ("keep_valid", "score"), ("only_open", "count")]
OPEN = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash map works.",
    "What are the main differences between TCP and UDP?",
    "Write a haiku about autumn.",
    "Summarise the plot of Romeo and Juliet.",
    "Give three tips for staying focused while studying.",
    "Why is the sky blue?",
    "Describe a day in the life of a lighthouse keeper.",
    "How do vaccines train the immune system?",
    "Invent a new board game and explain the rules.",
    "What makes a good cup of coffee?",
    "Compare cats and dogs as pets.",
    "Explain recursion to a ten-year-old.",
    "Write a limerick about a forgetful wizard.",
    "What causes the seasons on Earth?",
    "Describe the taste of a lemon to someone who never had one.",
    "How does a bicycle stay upright?",
    "Plan a picnic for four friends.",
    "What is the difference between weather and climate?",
    "Write a letter from a cat to its owner.",
    "Explain what a black hole is.",
    "Give advice to someone learning to cook.",
    "Why do leaves change colour in autumn?",
    "Describe your ideal city of the future.",
]


def repetitive_prompts(n: int, seed: int = 0) -> list[str]:
    rng, out, turn = random.Random(seed), [], 0
    transcript = "Task: find a hotel in {city} for {name}.\n"
    while len(out) < n:
        name, age, city = rng.choice(NAMES), rng.randint(20, 70), rng.choice(CITIES)
        out.append(f"Extract the person as JSON with keys name, age, city: {name} is {age} years old "
                   f"and lives in {city}. Answer with JSON only.")
        fn, attr = rng.choice(FUNCS)
        out.append(f"Add type hints to this function and return only the code:\n"
                   f"def {fn}(items, limit):\n    result = []\n    for item in items:\n"
                   f"        if item.{attr} > limit:\n            result.append(item)\n    return result")
        if turn == 0:
            log = transcript.format(city=city, name=name)
        log += f"Step {turn + 1}: search(hotels in {city}) -> 3 results: Hotel A, Hotel B, Hotel C.\n"
        out.append("You are an agent. Reply with the next tool call as `search(query)` or `book(hotel)` "
                   "and one sentence of reasoning.\n" + log)
        turn = (turn + 1) % 3
    return out[:n]


def run(target, drafter_dir, prompts: list[str], args) -> list[dict]:
    tok = target.tokenizer
    model = load_model_drafter(drafter_dir, target)
    suffix_cache, hybrid_cache, adaptive_cache = SuffixCache(), SuffixCache(), SuffixCache()
    fixed = EngineConfig(draft=DraftLengthConfig(k=args.k))
    long = EngineConfig(draft=DraftLengthConfig(k=args.suffix_k))
    adaptive = EngineConfig(draft=DraftLengthConfig(k=args.suffix_k, adaptive=True))
    rows = {
        "no drafter": (SpeculativeEngine.for_model(target, NoDrafter()), None),
        f"model drafter k={args.k}": (SpeculativeEngine.for_model(target, model, fixed), None),
        f"suffix k≤{args.suffix_k}": (SpeculativeEngine.for_model(target, SuffixDrafter(suffix_cache), long),
                                       suffix_cache),
        f"hybrid (suffix k≤{args.suffix_k}, else model k={args.k}; threshold {args.threshold})": (
            SpeculativeEngine.for_model(target, HybridDrafter(SuffixDrafter(hybrid_cache), model, args.threshold,
                                                              model_k=args.k), long), hybrid_cache),
        f"hybrid, adaptive k≤{args.suffix_k} (serve's default)": (
            SpeculativeEngine.for_model(target, HybridDrafter(SuffixDrafter(adaptive_cache), model, args.threshold),
                                        adaptive), adaptive_cache),
    }
    acc = {name: {"s": 0.0, "tokens": 0, "stats": [], "match": True, "sources": {}} for name in rows}
    rows["no drafter"][0].generate(encode(tok, prompts[0], chat=True), SamplingParams(max_new_tokens=4))  # warm-up
    for i, p in enumerate(prompts):
        ids, ref = encode(tok, p, chat=True), None
        for name, (engine, cache) in rows.items():
            t = time.perf_counter()
            res = engine.generate(ids, SamplingParams(max_new_tokens=args.max_new_tokens))
            a = acc[name]
            a["s"] += time.perf_counter() - t
            a["tokens"] += len(res.output_ids)
            a["stats"].append(res.stats)
            ref = ref if ref is not None else res.output_ids
            a["match"] &= res.output_ids == ref
            for s in res.trace.steps:
                if s.drafted:
                    src = a["sources"].setdefault(s.source, [0, 0, 0])
                    src[0], src[1], src[2] = src[0] + 1, src[1] + len(s.drafted), src[2] + s.accepted
            if cache is not None:
                cache.add_sequence(res.output_ids)  # what the maintainer would apply from the stream
        print(f"  request {i + 1}/{len(prompts)}", flush=True)
    out = []
    for name, a in acc.items():
        st = RequestStats.total(a["stats"])
        out.append({"row": name, "tokens_per_s": round(a["tokens"] / a["s"], 2),
                    "mean_acceptance_length": round(st.mean_acceptance_length, 3),
                    "acceptance_rate": round(st.acceptance_rate, 3), "outputs_equal_no_drafter": a["match"],
                    "steps_by_source": {k: {"steps": v[0], "drafted": v[1], "accepted": v[2]}
                                        for k, v in a["sources"].items()}})
    base = out[0]["tokens_per_s"]
    for r in out:
        r["speedup"] = round(r["tokens_per_s"] / base, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", help="model drafter dir (default: derive one with --layers)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--requests", type=int, default=24, help="per workload")
    ap.add_argument("--k", type=int, default=4, help="model drafter draft length")
    ap.add_argument("--suffix-k", type=int, default=8, help="max draft length for suffix and hybrid")
    ap.add_argument("--threshold", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="bench/results/hybrid.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_model(args.target)
    ddir = Path(args.drafter) if args.drafter else derive_drafter(target, args.layers, Path("bench/results/drafter"))
    result = {"meta": {"target": target.model_id, "drafter": str(ddir), "layers": args.layers, **vars(args),
                       "torch_threads": torch.get_num_threads(), "machine": platform.machine(),
                       "cpus": os.cpu_count(), "nice": os.nice(0)}}
    for name, prompts in (("repetitive", repetitive_prompts(args.requests)),
                          ("open-ended", (OPEN * (1 + args.requests // len(OPEN)))[: args.requests])):
        print(f"workload {name}", flush=True)
        result[name] = run(target, ddir, prompts, args)
    for name in ("repetitive", "open-ended"):
        print(f"\n{name}\n| drafter | tokens/s | speedup | mean acc. length | acc. rate | same output |")
        print("|---|---|---|---|---|---|")
        for r in result[name]:
            print(f"| {r['row']} | {r['tokens_per_s']} | {r['speedup']}× | {r['mean_acceptance_length']} | "
                  f"{r['acceptance_rate']} | {r['outputs_equal_no_drafter']} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
