"""Offline distillation of a derived drafter, so the engine benchmark compares drafters that draft well.

An untrained drafter derived from the target's first layers has a mean
acceptance length of ~1.1: no speculative method wins with it. This script
derives one (optionally VocabTrim-ed to the most frequent tokens of the
target's own outputs), has the target answer `--requests` prompts from the
built-in general pool greedily (batched), and distils the drafter on those
traces with the project's trainer (online/trainer/distill.py), with the
target's top-k soft labels at every output position. It then reports the
mean acceptance length before and after on held-out prompts (teacher-forced
replay, exact for greedy). The engine benchmark's own prompts are not in the pool.

    python -m bench.train_drafter --layers 4 --vocab-top 8192 --requests 256 --steps 200 \
        --out bench/results/drafter-distilled
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from bench.traffic import (
    THREADS_HELP,
    chat_ids,
    full_label_trace,
    greedy_traffic,
    prompt_pool,
    start_run,
    teacher_forced_replay,
)
from online.config import TrainerConfig
from online.trainer.distill import distill
from runtime.derive import derive_drafter
from runtime.drafters.factory import load_model_drafter
from runtime.loader import load_model
from runtime.stats import RequestStats


def mal(drafter_dir: Path, target, traffic, k: int) -> float:
    stats = RequestStats.total(teacher_forced_replay(load_model_drafter(drafter_dir, target), traffic, k))
    return round(stats.mean_acceptance_length, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab-top", type=int, default=8192, help="VocabTrim head rows (0: full head)")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--heldout", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--max-seconds", type=float, default=0.0)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help=THREADS_HELP)
    ap.add_argument("--out", default="bench/results/drafter-distilled")
    args = ap.parse_args()
    out, work = start_run(args)

    t0 = time.perf_counter()
    target = load_model(args.target)
    prompts = prompt_pool("general", args.requests + args.heldout, seed=1)
    ids = [chat_ids(target, p) for p in prompts]
    traffic = greedy_traffic(target, ids, args.max_new_tokens)
    train, heldout = traffic[: args.requests], traffic[args.requests :]
    t_gen = time.perf_counter() - t0
    print(f"target traffic: {len(traffic)} requests in {t_gen:.0f}s", flush=True)

    vocab_text = work / "vocab.txt"
    vocab_text.write_text("\n".join(target.tokenizer.decode(r.prompt_ids + r.output_ids) for r in train))
    base = derive_drafter(target, args.layers, work / "derived", vocab_top=args.vocab_top or None,
                          text_file=vocab_text if args.vocab_top else None)
    before = mal(base, target, heldout, args.k)
    traces = [full_label_trace(r, f"offline-{i}", target.model_id) for i, r in enumerate(train)]
    cfg = TrainerConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, max_seconds=args.max_seconds,
                        ce_weight=0.5, loss="fkl")
    shutil.rmtree(out, ignore_errors=True)
    res = distill(base, traces, out, cfg, version=f"{target.model_id}-{args.layers}l-distilled",
                  provenance={"offline": "bench/train_drafter.py", "requests": len(train)})
    after = mal(out, target, heldout, args.k)
    summary = {"target": target.model_id, "layers": args.layers, "vocab_top": args.vocab_top,
               "train_requests": len(train), "heldout_requests": len(heldout), "steps": res.steps,
               "train_seconds": round(res.seconds, 1), "generate_seconds": round(t_gen, 1),
               "loss_first": round(res.losses[0], 4), "loss_last": round(res.losses[-1], 4),
               f"heldout_mean_acceptance_length_k{args.k}_before": before,
               f"heldout_mean_acceptance_length_k{args.k}_after": after, "out": str(out)}
    (out / "offline_distill.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
