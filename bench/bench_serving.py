"""Serving benchmark: total tokens/s and latency through the HTTP server at 1, 4, 8 and 16 concurrent
clients, the batched engine (continuous batching, `serve.max_batch`) against the serial one
(`max_batch = 1`), in one run on one machine.

Each client sends `--requests` greedy completions back to back (distinct chat prompts of the
general pool); every output is checked against that prompt's solo output (the engine alone,
one request at a time). Rows alternate serial / batched per client count.

    python -m bench.bench_serving --drafter-kind eagle --drafter bench/results/eagle-smol --max-batch 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time

from bench.traffic import THREADS_HELP, chat_ids, prompt_pool, start_run
from online.config import Config
from online.serving.engine import start_serving
from online.traffic.generator import complete
from runtime.drafters.factory import DrafterConfig, build_drafter
from runtime.drafters.none import NoDrafter
from runtime.engine import SamplingParams, SpeculativeEngine, StepFacts
from runtime.loader import load_model


def run_clients(url: str, prompts: list[list[int]], clients: int, per_client: int, max_tokens: int) -> dict:
    latencies, outputs, lock = [], {}, threading.Lock()

    def client(c: int) -> None:
        for j in range(per_client):
            i = (c * per_client + j) % len(prompts)
            t = time.perf_counter()
            body = complete(url, prompts[i], max_tokens=max_tokens)
            with lock:
                latencies.append(time.perf_counter() - t)
                outputs.setdefault(i, []).append(body["livedraft"]["output_ids"])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(len(o) for outs in outputs.values() for o in outs)
    lat = sorted(latencies)
    return {"tokens_per_s": tokens / wall, "requests": len(lat), "p50_s": statistics.median(lat),
            "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))], "outputs": outputs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter-kind", default="eagle")
    ap.add_argument("--drafter", help="drafter directory (kinds model, eagle, hybrid)")
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--requests", type=int, default=4, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--adaptive", action="store_true", help="adaptive k (default: fixed --k)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help=THREADS_HELP)
    ap.add_argument("--out", default="bench/results/serving")
    args = ap.parse_args()
    out, _work = start_run(args)
    load0 = os.getloadavg()[0]
    target = load_model(args.target)
    levels = [int(x) for x in args.clients.split(",")]
    n_prompts = max(levels) * args.requests
    prompts = [chat_ids(target, p) for p in prompt_pool("general", n_prompts, seed=11)]
    solo_engine = SpeculativeEngine.for_model(target, NoDrafter())
    solo = [solo_engine.generate(p, SamplingParams(max_new_tokens=args.max_tokens)).output_ids for p in prompts]
    print(f"solo outputs of {len(prompts)} prompts computed", flush=True)
    results = []
    handles = {}
    k_rows = KByRows()
    for mode, batch in (("serial", 1), ("batched", args.max_batch)):
        cfg = Config()
        cfg.serve.port, cfg.serve.max_batch, cfg.serve.adaptive, cfg.serve.k = 0, batch, args.adaptive, args.k
        cfg.serve.max_queue, cfg.serve.max_queue_per_client = 256, 64
        drafter = build_drafter(DrafterConfig(kind=args.drafter_kind, path=args.drafter), target)
        handles[mode] = start_serving(cfg, target=target, initial_drafter=drafter)
        if mode == "batched":
            handles[mode].engine.step_observers.append(k_rows)
        complete(handles[mode].url, prompts[0], max_tokens=8)  # warm-up (and the adaptive cost model)
    try:
        for clients in levels:
            for mode in ("serial", "batched"):
                r = run_clients(handles[mode].url, prompts, clients, args.requests, args.max_tokens)
                same = all(o == solo[i] for i, outs in r.pop("outputs").items() for o in outs)
                row = {"clients": clients, "engine": mode, **{k: round(v, 3) for k, v in r.items()},
                       "outputs_equal_solo": same}
                results.append(row)
                print(row, flush=True)
    finally:
        for h in handles.values():
            h.stop(30)
    by = {(r["clients"], r["engine"]): r for r in results}
    meta = {"target": target.model_id, "drafter_kind": args.drafter_kind, "drafter": args.drafter,
            "max_batch": args.max_batch, "adaptive": args.adaptive, "k": args.k, "max_tokens": args.max_tokens,
            "requests_per_client": args.requests, "threads": args.threads,
            "loadavg_1min_start_end": [round(load0, 2), round(os.getloadavg()[0], 2)]}
    print(f"\n{meta}\n")
    print("| clients | serial tokens/s | batched tokens/s | × serial | serial p50 / p99 s | batched p50 / p99 s "
          "| outputs = solo |")
    print("|---|---|---|---|---|---|---|")
    for c in levels:
        s, b = by[(c, "serial")], by[(c, "batched")]
        print(f"| {c} | {s['tokens_per_s']:.1f} | {b['tokens_per_s']:.1f} | "
              f"{b['tokens_per_s'] / s['tokens_per_s']:.2f} | "
              f"{s['p50_s']:.2f} / {s['p99_s']:.2f} | {b['p50_s']:.2f} / {b['p99_s']:.2f} | "
              f"{s['outputs_equal_solo'] and b['outputs_equal_solo']} |")
    rule = batch_k_rule(handles["batched"].engine, k_rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_serving.json").write_text(json.dumps({"meta": meta, "rows": results, "batch_k_rule": rule}, indent=2))


class KByRows:
    """An engine step observer: rows in a decode step -> [steps, sum of each step's widest draft,
    tokens yielded], what the batch-level k rule chose at each batch size."""

    def __init__(self) -> None:
        self.by: dict[int, list[int]] = {}

    def __call__(self, step: StepFacts) -> None:
        rec = self.by.setdefault(len(step.reqs), [0, 0, 0])
        rec[0] += 1
        rec[1] += max(step.ks, default=0)
        rec[2] += sum(len(g) for g in step.gained)


def batch_k_rule(engine: SpeculativeEngine, k_rows: KByRows) -> list[dict]:
    """What the batched engine did at each batch size over the whole run: decode steps, the mean of
    each step's widest draft (with --adaptive: the cap the cost-aware rule chose), tokens per row per
    step, and the measured seconds of a target forward feeding rows x (k + 1) tokens for k = 0 and k = 4.
    Printed as a table."""
    rows = []
    for n, (steps, k_sum, tokens) in sorted(k_rows.by.items()):
        v1, v5 = engine.costs.verify(n), engine.costs.verify(n * 5)
        rows.append({"rows": n, "steps": steps, "mean_k": round(k_sum / steps, 2),
                     "tokens_per_row_step": round(tokens / (steps * n), 2),
                     "verify_ms_k0": round(1e3 * v1, 1) if v1 else None,
                     "verify_ms_k4": round(1e3 * v5, 1) if v5 else None})
    print("\n| rows in step | steps | mean k | tokens / row / step | target forward ms, k = 0 | k = 4 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rows']} | {r['steps']} | {r['mean_k']} | {r['tokens_per_row_step']} | {r['verify_ms_k0']} | "
              f"{r['verify_ms_k4']} |")
    return rows


if __name__ == "__main__":
    main()
