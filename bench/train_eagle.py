"""Warm start of an EAGLE-3 head for SmolLM2-135M on CPU: held-out acceptance against training time.

Training prompts: `--requests` distinct general-pool chat prompts and `--synthesized`
prompts the target writes itself (Magpie: sampled from the chat template's user turn,
`online.trainer.warmstart.synthesize_prompts`), which follow the target's own
instruction-tuning distribution rather than the pool's templates. The target answers
them greedily (the batched engine, 16 requests at a time; `--sampled` adds sampled
answers). Held out: `--heldout` further general-pool prompts (none trained on), and,
reported beside them at the end, the engine benchmark's own prompts
(bench/bench_engine.PROMPTS, in no pool). `online.trainer.warmstart.warm_start` (what
`livedraft drafter train` runs) trains a new head within `--minutes` of training,
replaying the held-out traffic every `--eval-every` steps (teacher-forced, exact for
greedy, draft length --k). The answers are kept in `--out`_data.jsonl and reused by a
rerun with the same data settings (`--data-only` stops after making them). Prints the
curve as a Markdown table and writes it, with the timings of each phase and the
machine's load, to `--out`/bench_summary.json.

    python -m bench.train_eagle --requests 500 --synthesized 500 --heldout 50 --max-new-tokens 96 \
        --minutes 30 --out bench/results/eagle-smol
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

from bench.traffic import THREADS_HELP, chat_ids, prompt_pool, start_run
from online.config import MIXED_PRECISION, TrainerConfig
from online.stream.events import trace_from_json, trace_to_json
from online.trainer.warmstart import answer_prompts, sampled_answers, synthesize_prompts, warm_start
from runtime.loader import load_model
from runtime.trace import RequestTrace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=520)
    ap.add_argument("--heldout", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=30.0, help="training time budget (evaluations excluded)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--eval-every", type=int, default=150)
    ap.add_argument("--synthesized", type=int, default=0,
                    help="extra training prompts written by the target itself (Magpie), answered like the pool's")
    ap.add_argument("--sampled", type=int, default=0,
                    help="extra answers per training prompt, sampled at --temperature (more data; held-out stays "
                         "greedy)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--mixed-precision", choices=MIXED_PRECISION, default="no",
                    help="bf16: the head's matmuls in bfloat16 (TrainerConfig.mixed_precision)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2, help=THREADS_HELP)
    ap.add_argument("--out", default="bench/results/eagle-smol")
    ap.add_argument("--data-only", action="store_true", help="make (or check) the answers, then stop")
    args = ap.parse_args()
    if args.requests + args.synthesized <= 0 or args.heldout <= 0:
        raise SystemExit("need at least one training prompt (--requests/--synthesized) and --heldout > 0")
    out, work = start_run(args)
    shutil.rmtree(out, ignore_errors=True)
    load0 = os.getloadavg()[0]

    target = load_model(args.target)
    t0 = time.perf_counter()
    train, heldout, bench_prompts = make_data(target, args, Path(f"{out}_data.jsonl"))
    gen_s = time.perf_counter() - t0
    tokens = sum(len(t.output_ids) for t in train + heldout)
    print(f"data: {len(train)} training and {len(heldout)} held-out requests, {tokens} tokens ({gen_s:.0f}s)",
          flush=True)
    if args.data_only:
        return
    cfg = TrainerConfig(steps=1_000_000, max_seconds=args.minutes * 60, batch_size=args.batch_size, lr=args.lr,
                        ce_weight=0.2, warmup_steps=20, draft_vocab=args.draft_vocab,
                        mixed_precision=args.mixed_precision)

    def progress(event: str, data: dict) -> None:
        if event == "eval":
            print(f"step {data['step']:5d}  train {data['train_seconds']:6.0f}s  held-out MAL "
                  f"{data['heldout_mean_acceptance_length']:.3f}  first-token acceptance "
                  f"{data['heldout_first_token_acceptance']:.3f}  loss {data['loss']:.3f}", flush=True)

    res = warm_start(target, train, heldout, out, cfg, k=args.k, eval_every=args.eval_every,
                     version="eagle-warm", on_progress=progress)
    bench_eval = replay_heldout(target, out, bench_prompts, args.k)
    summary = {"target": target.model_id, "train_requests": len(train), "heldout_requests": len(heldout),
               "general_pool_requests": args.requests, "synthesized_requests": args.synthesized,
               "bench_engine_prompts": bench_eval, "sampled_per_prompt": args.sampled,
               "temperature": args.temperature if args.sampled else None,
               "max_new_tokens": args.max_new_tokens, "generate_seconds": round(gen_s, 1),
               "feature_seconds": round(res.feature_seconds, 1), "train_seconds": round(res.train_seconds, 1),
               "steps": res.steps, "mixed_precision": args.mixed_precision, "k": args.k, "threads": args.threads,
               "loadavg_1min_start_end": [round(load0, 2), round(os.getloadavg()[0], 2)],
               "curve": [p.__dict__ for p in res.curve]}
    (out / "bench_summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\n{ {k: v for k, v in summary.items() if k != 'curve'} }\n")
    print(f"| training time | steps | held-out mean acceptance length (k={args.k}) | first-token acceptance |")
    print("|---|---|---|---|")
    for p in res.curve:
        print(f"| {p.train_seconds / 60:.1f} min | {p.step} | {p.heldout_mean_acceptance_length:.3f} | "
              f"{p.heldout_first_token_acceptance:.3f} |")
    print(f"\nthe engine benchmark's {len(bench_prompts)} prompts (in no training pool), k={args.k}: mean acceptance "
          f"length {bench_eval['mean_acceptance_length']}, "
          f"first-token acceptance {bench_eval['first_token_acceptance']}")
    shutil.rmtree(work, ignore_errors=True)


DATA_KEYS = ("target", "requests", "heldout", "synthesized", "sampled", "temperature", "max_new_tokens")


def make_data(target, args, path: Path) -> tuple[list[RequestTrace], list[RequestTrace], list[RequestTrace]]:
    """(training traces, held-out general-pool traces, the engine benchmark's prompts answered), from
    `path` when it was made with the same settings, else made and written there."""
    from bench.bench_engine import PROMPTS

    key = {k: getattr(args, k) for k in DATA_KEYS}
    if path.is_file():
        lines = path.read_text().splitlines()
        if lines and json.loads(lines[0]) == key:
            traces = [trace_from_json(line) for line in lines[1:]]
            by = {tag: [t for t in traces if t.tag == tag] for tag in ("train", "heldout", "bench")}
            print(f"answers from {path}", flush=True)
            return by["train"], by["heldout"], by["bench"]
    pool = prompt_pool("general", args.requests + args.heldout, seed=1)
    if len(set(pool)) != len(pool):
        raise SystemExit(f"the general pool has fewer than {len(pool)} distinct prompts: held-out prompts would "
                         "repeat training prompts; lower --requests/--heldout")
    t0 = time.perf_counter()
    done = [0]

    def answered(n: int) -> None:
        done[0] += n
        print(f"  target answered {done[0]}/{total} prompts ({time.perf_counter() - t0:.0f}s)", flush=True)

    synth: list[str] = []
    if args.synthesized:
        made = [0]

        def wrote(n: int) -> None:
            made[0] += n  # a call per chunk of four batches that kept any
            print(f"  target wrote {made[0]}/{args.synthesized} prompts ({time.perf_counter() - t0:.0f}s)", flush=True)

        held = set(pool) | set(PROMPTS)
        synth = [p for p in synthesize_prompts(target, args.synthesized + 16, seed=11, progress=wrote)
                 if p not in held][: args.synthesized]
    train_ids = [chat_ids(target, p) for p in pool[: args.requests] + synth]
    held_ids = [chat_ids(target, p) for p in pool[args.requests:]]
    bench_ids = [chat_ids(target, p) for p in PROMPTS]
    total = len(train_ids) * (1 + args.sampled) + len(held_ids) + len(bench_ids)
    train = answer_prompts(target, train_ids, args.max_new_tokens, progress=answered)
    train += sampled_answers(target, train_ids, args.max_new_tokens, args.sampled, args.temperature, progress=answered)
    heldout = answer_prompts(target, held_ids, args.max_new_tokens, progress=answered)
    bench = answer_prompts(target, bench_ids, args.max_new_tokens, progress=answered)
    for tag, traces in (("train", train), ("heldout", heldout), ("bench", bench)):
        for t in traces:
            t.tag = tag
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join([json.dumps(key)] + [trace_to_json(t) for t in train + heldout + bench]) + "\n")
    tmp.replace(path)
    return train, heldout, bench


def replay_heldout(target, head_dir: Path, traces: list[RequestTrace], k: int) -> dict:
    """Teacher-forced replay of `traces` with the head in `head_dir` at draft length k."""
    from online.trainer.round import target_passes
    from online.trainer.warmstart import heldout_acceptance
    from runtime.drafters.eagle import EagleHead

    head = EagleHead.load(head_dir, dtype=target.model.dtype, device=target.model.device)
    mal, first = heldout_acceptance(head, target, traces, target_passes(target, head.config.aux_layers, traces), k)
    return {"requests": len(traces), "mean_acceptance_length": round(mal, 3), "first_token_acceptance": round(first, 3)}


if __name__ == "__main__":
    main()
