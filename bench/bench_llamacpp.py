"""llama-server benchmark: livedraft's heads on llama.cpp against llama-server alone, side by side.

Rows (same chat prompts, greedy, same n_predict), each a llama-server process started once:
llama-server alone on the f32 GGUF (with the flash attention livedraft measured faster here, and
with llama.cpp's default where that differs) and on the packaged Q4_1 GGUF; per `--head DIR` (an EAGLE-3
head) the head under livedraft's cost rule (its acceptance per position measured on separate
calibration prompts with a fixed n-max 3 run, then `choose_spec` with this machine's step costs
measured on llama-server: no head where it does not pay) and the head at llama-server's fixed n-max 3;
llama.cpp's own n-gram drafting (`ngram-mod`, `ngram-simple`); and our engine, target only. Where
the cost rule serves a head, a "+ live check" row replays what serving adds (`RuleGuard`): over the
prompts in order, the cost rule's requests until a window of them (requests or decoding steps)
gave under 1.0x by llama-server's counts, then the head-less restart's, whose command line is
llama-server alone's, so that row's requests stand for it. For
each prompt every row runs back to back (interleaved, so machine drift hits all rows alike); the
table reports the median over prompts of tokens/s, its ratio to llama-server alone (f32), drafted
and accepted tokens, and the head's cost per drafted token as a fraction of a target step.

    python -m bench.bench_llamacpp --llama-server PATH --f32 smollm2-f32.gguf --head drafters/eagle1
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
import urllib.request
from pathlib import Path

from bench.bench_do_no_harm import cpu
from bench.bench_engine import PROMPTS
from online.commands.engine import llamacpp_locations
from online.config import load_config
from online.serving.llama import RuleGuard, UpstreamFactory, head_gguf, resolve_llama_target
from runtime.llamacpp.binary import find_llama_bench
from runtime.llamacpp.costs import (
    acceptance_from_counts,
    choose_spec,
    draft_cost,
    measure_forward_costs,
    served_speedup,
)
from runtime.llamacpp.upstream import LaunchSpec, SpecParams, Upstream
from runtime.loader import PACKAGED, _packaged_file

CALIBRATION = ["Tell me a story about a dragon who was afraid of the dark.",
               "Explain what a linked list is.", "Give three tips for writing clear emails."]
BASE = "llama-server alone (f32)"


def chat(tok, prompt: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False)


def completion(up: Upstream, ids: list[int], n: int) -> tuple[list[int], float, dict]:
    body = json.dumps({"prompt": ids, "n_predict": n, "temperature": 0.0, "return_tokens": True,
                       "cache_prompt": False}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{up.port}/completion", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return out["tokens"], time.perf_counter() - t0, out.get("timings", {})


def calibrate(launch: LaunchSpec, tok, n: int, max_new: int, prompts: list[str]) -> list[float]:
    """The head's acceptance per position from a fixed n-max run over the calibration prompts."""
    up = Upstream(launch, version="calibration").start()
    try:
        steps = accepted = 0
        for p in prompts:
            out, _, t = completion(up, chat(tok, p), max_new)
            accepted += int(t.get("draft_n_accepted", 0))
            steps += len(out) - int(t.get("draft_n_accepted", 0))
        return acceptance_from_counts(steps, accepted, n)
    finally:
        up.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--f32", help="the target's f32 GGUF (default: written with llama.cpp's converter)")
    ap.add_argument("--q4", help="a quantized GGUF row (default: the packaged Q4_1 file for smollm2-135m)")
    ap.add_argument("--head", action="append", default=[], help="an EAGLE-3 head directory (repeatable)")
    ap.add_argument("--llama-server", help="the binary (default: as `livedraft serve` finds it)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompts-file", help="prompts, one per line (chat-wrapped; default: the engine bench's)")
    ap.add_argument("--calibration-file", help="prompts the heads' acceptance is measured on, one per line "
                                                 "(default: three general chat prompts)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-ours", action="store_true", help="leave out our engine's target-only row")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()

    cfg = load_config()
    cfg.engine.threads, cfg.engine.parallel, cfg.engine.ctx_per_slot = args.threads, 1, 1024
    cfg.engine.target_type = "f32"
    base_target = resolve_llama_target(args.target, cfg)
    f32 = Path(args.f32) if args.f32 else resolve_llama_target(str(base_target.hf_dir), cfg).gguf
    q4 = Path(args.q4) if args.q4 else (_packaged_file(args.target) if args.target in PACKAGED else None)
    target = type(base_target)(f32, base_target.hf_dir, base_target.model_id)
    factory = UpstreamFactory(cfg, target, binary=args.llama_server)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target.hf_dir)
    forward = measure_forward_costs(find_llama_bench(args.llama_server, llamacpp_locations(cfg)), target.gguf,
                                    threads=args.threads)
    lines = lambda f: [ln.strip() for ln in Path(f).read_text().splitlines() if ln.strip()]  # noqa: E731
    calibration = lines(args.calibration_file) if args.calibration_file else CALIBRATION
    texts = lines(args.prompts_file) if args.prompts_file else PROMPTS
    launches: dict[str, LaunchSpec] = {BASE: factory.launch()}
    if factory.flash_attn():  # the alone row as llama.cpp would start it, beside livedraft's measured choice
        launches[f"{BASE}, flash attention llama.cpp's default"] = LaunchSpec(
            **{**factory.launch().__dict__, "flash_attn": ""})
    if q4 is not None:
        launches[f"llama-server alone ({q4.stem})"] = LaunchSpec(**{**factory.launch().__dict__, "model": q4})
    notes, guarded = {}, {}
    for d in args.head:
        head = head_gguf(Path(d), target)
        steps = factory.step_costs(head)
        fixed = factory.launch(head, SpecParams(3, 0.0))
        acc = calibrate(fixed, tok, 3, args.max_new_tokens, calibration)
        spec, expected = choose_spec(acc, steps, margin=cfg.engine.min_speedup)
        name = Path(d).name
        launches[f"{name}, cost rule"] = factory.launch(head if spec.n_max else None, spec)
        launches[f"{name}, fixed n-max 3"] = fixed
        if spec.n_max:
            guarded[f"{name}, cost rule + live check"] = (f"{name}, cost rule", steps, spec.n_max)
        notes[name] = {"flash_attn": factory.flash_attn() or "llama.cpp's default",
                       "step_cost_C(1..4)": [round(steps.ratio(n), 3) for n in range(1, steps.max_n + 1)],
                       "draft_cost_per_token_at_n3": round(draft_cost(steps, forward, 3), 4),
                       "calibrated_acceptance": [round(a, 3) for a in acc],
                       "rule": spec.__dict__, "expected_speedup": round(expected, 3)}
        if factory.flash_attn():  # what the same head's steps cost with llama.cpp's default
            default = copy.deepcopy(cfg)
            default.engine.flash_attn = "on"
            on = UpstreamFactory(default, target, binary=args.llama_server).step_costs(head)
            notes[name]["step_cost_C(1..4)_flash_attn_on"] = [round(on.ratio(n), 3) for n in range(1, on.max_n + 1)]
    for kind in ("ngram-mod", "ngram-simple"):
        launches[kind] = LaunchSpec(**{**factory.launch().__dict__, "extra": ("--spec-type", kind)})

    ups = {name: Upstream(launch, version=name).start() for name, launch in launches.items()}
    ours = None
    if not args.no_ours:
        import torch

        from runtime.drafters.none import NoDrafter
        from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine
        from runtime.loader import load_model

        torch.set_num_threads(args.threads)
        model = load_model(args.target)
        ours = SpeculativeEngine.for_model(model, NoDrafter(), EngineConfig())
    rows: dict[str, list] = {name: [] for name in [*launches, *(["ours, target only (fp32)"] if ours else [])]}
    prompts = [chat(tok, p) for p in (texts * 4)[: args.prompts]]
    try:
        for i, ids in enumerate(prompts):
            for name, up in ups.items():
                out, dt, t = completion(up, ids, args.max_new_tokens)
                rows[name].append({"tokens": len(out), "s": dt, "drafted": int(t.get("draft_n", 0)),
                                   "accepted": int(t.get("draft_n_accepted", 0)), "out": out})
            if ours is not None:
                t0 = time.perf_counter()
                res = ours.generate(ids, SamplingParams(max_new_tokens=args.max_new_tokens))
                rows["ours, target only (fp32)"].append({"tokens": len(res.output_ids), "s": time.perf_counter() - t0,
                                                         "drafted": 0, "accepted": 0, "out": res.output_ids})
            print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    finally:
        for up in ups.values():
            up.stop()
    for name, (ruled, steps, n_max) in guarded.items():
        rows[name], switched = live_check(rows[ruled], rows[BASE], steps, n_max)
        notes.setdefault(ruled.split(",")[0], {})["live_check_head_off_from_request"] = switched
    report(rows, notes, forward, args)


def live_check(ruled: list[dict], alone: list[dict], steps, n_max: int) -> tuple[list[dict], int | None]:
    """The requests a server with `RuleGuard` would have timed: the cost rule's, until a window
    of them (`RuleGuard.WINDOW` requests or `WINDOW_STEPS` steps) served under `FLOOR` by
    llama-server's counts, then llama-server alone's (the head-less restart is its command line).
    Returns the rows and the 1-based request from which the head is off (None: never)."""
    out, tokens, n_steps, drafted, n = [], 0, 0, 0, 0
    for i, r in enumerate(ruled):
        out.append(r)
        n, tokens, drafted = n + 1, tokens + r["tokens"], drafted + r["drafted"]
        n_steps += r["tokens"] - r["accepted"]
        if RuleGuard.window_full(n, n_steps):
            if served_speedup(tokens, n_steps, drafted, steps, n_max) < RuleGuard.FLOOR:
                return out + alone[i + 1:], i + 2
            n = tokens = n_steps = drafted = 0
    return out, None


def report(rows: dict, notes: dict, costs, args) -> None:
    tps = {name: statistics.median(r["tokens"] / r["s"] for r in rs) for name, rs in rows.items()}
    base_out = [r["out"] for r in rows[BASE]]
    load = os.getloadavg()[0]
    print(f"\nmachine: {cpu()}, {os.cpu_count()} cores, load average "
          f"{load:.1f}; {args.threads} threads; {len(base_out)} chat prompts x {args.max_new_tokens} tokens, greedy")
    print("target forward cost T(n)/T(1), n = 1..5 (llama-bench): "
          + " ".join(f"{costs.ratio(n):.2f}" for n in range(1, 6)))
    print(f"\n| row | tokens/s (median) | vs {BASE} | drafted | accepted | outputs = f32 alone |")
    print("|---|---|---|---|---|---|")
    for name, rs in rows.items():
        same = sum(r["out"] == b for r, b in zip(rs, base_out, strict=True))
        d, a = sum(r["drafted"] for r in rs), sum(r["accepted"] for r in rs)
        print(f"| {name} | {tps[name]:.1f} | {tps[name] / tps[BASE]:.2f}x | {d} | {a} | {same}/{len(rs)} |")
    for name, n in notes.items():
        print(f"\n{name}: {json.dumps(n)}")
    if args.out:
        Path(args.out).write_text(json.dumps({"tokens_per_s": tps, "notes": notes,
                                              "rows": {k: [{**r, "out": None} for r in v] for k, v in rows.items()}},
                                             indent=1))


if __name__ == "__main__":
    main()
