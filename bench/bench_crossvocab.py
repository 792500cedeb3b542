"""Cross-vocabulary drafting: stories260K (512-token SentencePiece vocabulary) drafting for SmolLM2-135M
(49,152-token BPE), side by side in one run on the same story-continuation prompts, greedy.

Rows: the target alone (ours, and Hugging Face `generate`); Hugging Face universal assisted
generation with the same drafter (`assistant_model=` + `tokenizer=` + `assistant_tokenizer=`,
`num_assistant_tokens=k`, constant schedule); ours frozen (the drafter as given, translating by
text, no n-gram cache); ours adapted: after serving `--adapt-requests` other story prompts with
the frozen drafter, the online n-gram cache holds those outputs and `--rounds` replay-gated
rounds of hybrid distillation (online/trainer/crossvocab.py) have updated the drafter, exactly
as the daemon would. Every row runs back to back per prompt (interleaved); medians over prompts.

    python -m bench.bench_crossvocab --prompts 8 --max-new-tokens 64 --k 4 --rounds 3
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch

from bench.traffic import THREADS_HELP, start_run
from online.config import TrainerConfig
from online.trainer.round import ListSource, run_round
from runtime.adaptive import DraftLengthConfig
from runtime.drafters.crossvocab import CrossVocabDrafter
from runtime.drafters.none import NoDrafter
from runtime.drafters.vocab_bridge import VocabBridge
from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine
from runtime.loader import DRAFTER_META, load_model
from runtime.stats import RequestStats

WHO = ["a little girl named Lily", "a boy named Tom", "a small dog", "a big bear", "a happy cat", "an old man",
       "a little bird", "a kind girl named Sue", "a brave boy named Ben", "a tiny fish"]
WHAT = ["wanted to play in the park", "found a shiny red ball", "was sad because it was raining",
        "went to the beach with mom", "wanted a big cake", "saw a pretty flower", "lost a favorite toy",
        "made a new friend"]


def story_prompts(n: int, offset: int) -> list[str]:
    """Story continuations ("Once upon a time, there was ... One day,"), distinct for offsets far apart."""
    pool = [f"Once upon a time, there was {w} who {x}. One day," for w in WHO for x in WHAT]
    return [pool[(offset + i * 7) % len(pool)] for i in range(n)]


class ForwardCounter:
    """Counts the target's forward passes: HF's mean acceptance length is (tokens - 1) / (forwards - 1)
    (the prefill forward yields the first token; every later forward is one verify step)."""

    def __init__(self, model) -> None:
        self.n = 0
        model.register_forward_pre_hook(self._count)

    def _count(self, *_) -> None:
        self.n += 1


def hf_uag(target, drafter, ids: list[int], max_new: int, k: int) -> tuple[list[int], float]:
    assistant = copy.copy(drafter.model)
    assistant.generation_config = copy.deepcopy(drafter.model.generation_config)
    assistant.generation_config.num_assistant_tokens = k
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    x = torch.tensor([ids])
    t = time.perf_counter()
    with torch.inference_mode():
        out = target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                                    assistant_model=assistant, tokenizer=target.tokenizer,
                                    assistant_tokenizer=drafter.tokenizer,
                                    pad_token_id=target.tokenizer.eos_token_id)
    return out[0, len(ids):].tolist(), time.perf_counter() - t


def hf_plain(target, ids: list[int], max_new: int) -> tuple[list[int], float]:
    x = torch.tensor([ids])
    t = time.perf_counter()
    with torch.inference_mode():
        out = target.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                                    pad_token_id=target.tokenizer.eos_token_id)
    return out[0, len(ids):].tolist(), time.perf_counter() - t


def adapt(target, drafter_dir: Path, work: Path, args) -> tuple[Path, VocabBridge, list[dict]]:
    """Serves the adaptation traffic with the frozen drafter (traces as logged), fills a bridge from
    their outputs, and runs replay-gated rounds of hybrid distillation; returns the champion."""
    d = load_model(drafter_dir)
    frozen = CrossVocabDrafter(d.model, d.tokenizer, target.tokenizer, version="frozen")
    engine = SpeculativeEngine.for_model(target, frozen, EngineConfig(draft=DraftLengthConfig(k=args.k), max_batch=8))
    prompts = [target.tokenizer(p).input_ids for p in story_prompts(args.adapt_requests, 40)]
    traces = [r.trace for r in engine.generate_batch(prompts, SamplingParams(max_new_tokens=args.max_new_tokens))]
    bridge = VocabBridge(target_tokenizer=target.tokenizer, drafter_tokenizer=d.tokenizer)
    for t in traces:
        bridge.add_sequence(t.output_ids, t.tag)
    champion, rounds = drafter_dir, []
    per = max(8, len(traces) // args.rounds)
    cfg = TrainerConfig(steps=args.steps, batch_size=8, lr=args.lr, ce_weight=1.0, promote_margin=0.0, seed=0)
    for r in range(args.rounds):
        window = ListSource(traces[: per * (r + 1)], holdout_fraction=0.2).window()
        res = run_round(window, champion, work / f"round{r}", cfg, champion_version=str(r), target=target)
        rounds.append({"round": r + 1, "promoted": res.promoted,
                       "candidate_mal": round(res.candidate.mean_acceptance_length, 3),
                       "champion_mal": round(res.champion.mean_acceptance_length, 3), "seconds": round(res.seconds, 1)})
        print(f"round {r + 1}: {res.reason}", flush=True)
        if res.promoted:
            champion = res.candidate_dir
    return champion, bridge, rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", default=str(Path(__file__).resolve().parents[2] / "shared/models/stories260K"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--adapt-requests", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=1, help=THREADS_HELP)
    ap.add_argument("--out", default="bench/results/crossvocab")
    args = ap.parse_args()
    out, work = start_run(args)
    load0 = os.getloadavg()[0]
    target = load_model(args.target)
    drafter_dir = work / "drafter"
    shutil.copytree(args.drafter, drafter_dir)
    (drafter_dir / DRAFTER_META).write_text(json.dumps({"kind": "crossvocab", "version": "stories260K"}))
    t0 = time.perf_counter()
    adapted_dir, bridge, rounds = adapt(target, drafter_dir, work, args)
    adapt_s = time.perf_counter() - t0
    d0, d1 = load_model(drafter_dir), load_model(adapted_dir)
    fixed = EngineConfig(draft=DraftLengthConfig(k=args.k))
    engines = {
        "ours, target only": SpeculativeEngine.for_model(target, NoDrafter()),
        "ours, frozen drafter": SpeculativeEngine.for_model(
            target, CrossVocabDrafter(d0.model, d0.tokenizer, target.tokenizer, version="frozen"), fixed),
        "ours, adapted (n-gram cache + hybrid distillation)": SpeculativeEngine.for_model(
            target, CrossVocabDrafter(d1.model, d1.tokenizer, target.tokenizer, bridge=bridge, version="adapted"),
            fixed),
    }
    rows = {name: {"tps": [], "stats": [], "match": []}
            for name in ["HF generate (target only)", "HF universal assisted", *engines]}
    counter = ForwardCounter(target.model)
    hf_tokens = hf_steps = 0
    prompts = [target.tokenizer(p).input_ids for p in story_prompts(args.prompts, 3)]
    hf_plain(target, prompts[0], 8)
    for eng in engines.values():
        eng.generate(prompts[0], SamplingParams(max_new_tokens=8))
    for i, ids in enumerate(prompts):
        ref, dt = hf_plain(target, ids, args.max_new_tokens)
        rows["HF generate (target only)"]["tps"].append(len(ref) / dt)
        rows["HF generate (target only)"]["match"].append(True)
        before = counter.n
        out_ids, dt = hf_uag(target, d0, ids, args.max_new_tokens, args.k)
        hf_tokens, hf_steps = hf_tokens + len(out_ids) - 1, hf_steps + counter.n - before - 1
        rows["HF universal assisted"]["tps"].append(len(out_ids) / dt)
        rows["HF universal assisted"]["match"].append(out_ids == ref)
        for name, eng in engines.items():
            t = time.perf_counter()
            res = eng.generate(ids, SamplingParams(max_new_tokens=args.max_new_tokens))
            rows[name]["tps"].append(len(res.output_ids) / (time.perf_counter() - t))
            rows[name]["stats"].append(res.stats)
            rows[name]["match"].append(res.output_ids == ref)
        print(f"prompt {i + 1}/{len(prompts)}", flush=True)
    base = statistics.median(rows["ours, target only"]["tps"])
    table = []
    for name, r in rows.items():
        med = statistics.median(r["tps"])
        st = RequestStats.total(r["stats"]) if r["stats"] else None
        mal = st.mean_acceptance_length if st and st.drafted else None
        if name == "HF universal assisted":
            mal = hf_tokens / hf_steps if hf_steps else None
        table.append({"row": name, "tokens_per_s": round(med, 2), "ratio_vs_target_only": round(med / base, 3),
                      "mean_acceptance_length": round(mal, 3) if mal else None,
                      "acceptance_rate": round(st.acceptance_rate, 3) if st and st.drafted else None,
                      "outputs_equal_target_greedy": all(r["match"])})
    meta = {"target": target.model_id, "drafter": "stories260K", "k": args.k, "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens, "adapt_requests": args.adapt_requests, "rounds": rounds,
            "adapt_seconds": round(adapt_s, 1), "bridge_mappings": bridge.mappings(),
            "threads": torch.get_num_threads(),
            "loadavg_1min_start_end": [round(load0, 2), round(os.getloadavg()[0], 2)]}
    print(f"\n{meta}\n")
    print("| row | tokens/s (median) | × target only (ours) | mean acc. length | acc. rate | outputs = target greedy |")
    print("|---|---|---|---|---|---|")
    for t in table:
        print(f"| {t['row']} | {t['tokens_per_s']} | {t['ratio_vs_target_only']} | "
              f"{t['mean_acceptance_length'] or '—'} | "
              f"{t['acceptance_rate'] if t['acceptance_rate'] is not None else '—'} | "
              f"{t['outputs_equal_target_greedy']} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_crossvocab.json").write_text(json.dumps({"meta": meta, "rows": table}, indent=2))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
