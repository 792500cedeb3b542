"""Warm start of an EAGLE-3 head for SmolLM2-135M on CPU: held-out acceptance against training time.

The target answers `--requests` + `--heldout` distinct general-pool chat prompts greedily
(the batched engine, 16 requests at a time); the last `--heldout` are held out (no prompt
of theirs is trained on),
and `online.trainer.warmstart.warm_start` (what `livedraft drafter train` runs) trains a
new head within `--minutes` of training, replaying the held-out traffic every
`--eval-every` steps (teacher-forced, exact for greedy, draft length --k). The engine
benchmark's own prompts are not in the pool. Prints the curve as a Markdown table and
writes it, with the timings of each phase and the machine's load, to `--out`/warm_start.json.

    python -m bench.train_eagle --requests 520 --heldout 50 --minutes 30 --out bench/results/eagle-smol
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

from bench.traffic import THREADS_HELP, chat_ids, prompt_pool, start_run
from online.config import TrainerConfig
from online.trainer.warmstart import answer_prompts, warm_start
from runtime.loader import load_model


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
    ap.add_argument("--sampled", type=int, default=0,
                    help="extra answers per training prompt, sampled at --temperature (more data; held-out stays greedy)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2, help=THREADS_HELP)
    ap.add_argument("--out", default="bench/results/eagle-smol")
    args = ap.parse_args()
    out, work = start_run(args)
    shutil.rmtree(out, ignore_errors=True)
    load0 = os.getloadavg()[0]

    target = load_model(args.target)
    pool = prompt_pool("general", args.requests + args.heldout, seed=1)
    if len(set(pool)) != len(pool):
        raise SystemExit(f"the general pool has fewer than {len(pool)} distinct prompts: held-out prompts would "
                         "repeat training prompts; lower --requests/--heldout")
    t0 = time.perf_counter()
    done = [0]

    def answered(n: int) -> None:
        done[0] += n
        total = len(pool) + args.sampled * args.requests
        print(f"  target answered {done[0]}/{total} prompts ({time.perf_counter() - t0:.0f}s)", flush=True)

    ids = [chat_ids(target, p) for p in pool]
    traces = answer_prompts(target, ids, args.max_new_tokens, progress=answered)
    train, heldout = traces[: args.requests], traces[args.requests:]
    for n in range(args.sampled):
        train += answer_prompts(target, ids[: args.requests], args.max_new_tokens, progress=answered,
                                temperature=args.temperature, seed=(n + 1) * 1_000_003)
    gen_s = time.perf_counter() - t0
    tokens = sum(len(t.output_ids) for t in train + heldout)
    print(f"target answers: {len(train) + len(heldout)} requests, {tokens} tokens in {gen_s:.0f}s", flush=True)
    cfg = TrainerConfig(steps=1_000_000, max_seconds=args.minutes * 60, batch_size=args.batch_size, lr=args.lr,
                        ce_weight=0.2, warmup_steps=20, draft_vocab=args.draft_vocab)

    def progress(event: str, data: dict) -> None:
        if event == "eval":
            print(f"step {data['step']:5d}  train {data['train_seconds']:6.0f}s  held-out MAL "
                  f"{data['heldout_mean_acceptance_length']:.3f}  first-token acceptance "
                  f"{data['heldout_first_token_acceptance']:.3f}  loss {data['loss']:.3f}", flush=True)

    res = warm_start(target, train, heldout, out, cfg, k=args.k, eval_every=args.eval_every,
                     version="eagle-warm", on_progress=progress)
    summary = {"target": target.model_id, "train_requests": len(train), "heldout_requests": len(heldout),
               "sampled_per_prompt": args.sampled, "temperature": args.temperature if args.sampled else None,
               "max_new_tokens": args.max_new_tokens, "generate_seconds": round(gen_s, 1),
               "feature_seconds": round(res.feature_seconds, 1), "train_seconds": round(res.train_seconds, 1),
               "steps": res.steps, "k": args.k, "threads": args.threads,
               "loadavg_1min_start_end": [round(load0, 2), round(os.getloadavg()[0], 2)],
               "curve": [p.__dict__ for p in res.curve]}
    (out / "bench_summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\n{ {k: v for k, v in summary.items() if k != 'curve'} }\n")
    print(f"| training time | steps | held-out mean acceptance length (k={args.k}) | first-token acceptance |")
    print("|---|---|---|---|")
    for p in res.curve:
        print(f"| {p.train_seconds / 60:.1f} min | {p.step} | {p.heldout_mean_acceptance_length:.3f} | "
              f"{p.heldout_first_token_acceptance:.3f} |")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
