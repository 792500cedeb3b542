"""Engine benchmark: ours vs Hugging Face generate, side by side in one process.

Rows (same prompts, greedy, same max_new_tokens): HF target-only `generate`, our engine
with NoDrafter (target only, on the lean forward), an EAGLE-3 head (`--eagle DIR`, fixed k
and adaptive), prompt lookup (ours and HF's `prompt_lookup_num_tokens=`), and, with
`--drafter DIR`, a model drafter with the same k in our engine and in HF assisted generation
(`assistant_model=`, its generation config set to `num_assistant_tokens=k`, schedule
"constant", confidence threshold 0 — transformers reads these from the assistant's own
generation_config). For each prompt every row runs back to back (interleaved, so machine
drift hits all rows alike); the table reports the median over prompts of tokens/s, its
ratio to HF target-only and to ours target-only, acceptance, and each drafter's cost per
draft token as a fraction of a target step (our target-only seconds per token).

Before the rows it measures what returning the EAGLE-3 features costs a verify forward
(k + 1 tokens, features on vs off, interleaved; the median ratio). After them, untimed, it
reports how well the head's confidence (its top probability) predicts acceptance.

    python -m bench.bench_engine --eagle bench/results/eagle-smol --k 4 --prompts 8 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from online.commands import generate
from online.commands.generate import encode
from runtime.adaptive import DraftLengthConfig
from runtime.calibration import ConfidenceCalibration
from runtime.drafters.factory import load_feature_drafter, load_model_drafter
from runtime.drafters.lookup import PromptLookupDrafter
from runtime.drafters.model import ModelDrafter
from runtime.drafters.none import NoDrafter
from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine
from runtime.loader import load_model
from runtime.stats import RequestStats
from runtime.target import LlamaTarget

PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a hash map works, step by step.",
    "Rewrite this function with type hints:\ndef add(a, b):\n    return a + b\ndef sub(a, b):\n    return a - b",
    "List five tips for staying focused while studying.",
    "Summarise the plot of Romeo and Juliet in a paragraph.",
    "Convert to JSON: name Alice, age 30, city Paris; name Bob, age 25, city Rome.",
    "What are the main differences between TCP and UDP?",
    "Write a haiku about autumn, then explain its imagery.",
]
HF_BASE = "HF generate (target only)"
OURS_BASE = "ours, target only"


class ScatterHead(torch.nn.Module):
    """A VocabTrim head as HF sees it: logits of the kept rows, -inf for every other target id."""

    def __init__(self, trimmed: torch.nn.Linear, kept_ids: torch.Tensor, vocab: int) -> None:
        super().__init__()
        self.trimmed, self.vocab = trimmed, vocab
        self.register_buffer("kept_ids", kept_ids)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        small = self.trimmed(h)  # [..., V']
        full = small.new_full((*small.shape[:-1], self.vocab), float("-inf"))
        full[..., self.kept_ids] = small
        return full


def hf_assistant(drafter: ModelDrafter, vocab: int, k: int) -> torch.nn.Module:
    """The same drafter weights for HF assisted generation, fixed k, no confidence stop."""
    model = copy.copy(drafter.model)  # shallow: shares the weights; only the head attribute differs
    model._modules = dict(model._modules)  # so replacing lm_head leaves the drafter's own model alone
    if drafter.kept_ids is not None:
        model.lm_head = ScatterHead(drafter.model.get_output_embeddings(), drafter.kept_ids, vocab)
    model.generation_config = copy.deepcopy(drafter.model.generation_config)
    model.generation_config.num_assistant_tokens = k
    model.generation_config.num_assistant_tokens_schedule = "constant"
    model.generation_config.assistant_confidence_threshold = 0.0
    return model


def read_prompts(spec: str, pool: list[str] = PROMPTS, kind: str = "chat") -> list[str]:
    """`--prompts`: a count of the built-in `kind` prompts `pool` (a count beyond them is an error, not
    a silent cut), or a prompts file as `livedraft generate` reads it."""
    if spec.isdigit():
        if not 1 <= int(spec) <= len(pool):
            raise SystemExit(f"--prompts {spec}: there are {len(pool)} built-in {kind} prompts "
                             "(or give a .txt / .jsonl file)")
        return pool[: int(spec)]
    return generate.read_prompts(spec)


def hf_row(model, ids: list[int], max_new: int, **kw) -> tuple[list[int], float]:
    x = torch.tensor([ids])
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False, **kw)
    return out[0, len(ids):].tolist(), time.perf_counter() - t


def ours_row(engine: SpeculativeEngine, ids: list[int], max_new: int) -> tuple[list[int], float, RequestStats]:
    t = time.perf_counter()
    res = engine.generate(ids, SamplingParams(max_new_tokens=max_new))
    return res.output_ids, time.perf_counter() - t, res.stats


def calibration(engine: SpeculativeEngine, prompts: list[list[int]], max_new: int) -> list[dict]:
    """The engine's drafter's confidence against acceptance (runtime/calibration.py) over `prompts`
    (greedy, the engine's fixed k; run untimed after the rows)."""
    observer = ConfidenceCalibration()
    engine.step_observers.append(observer)
    try:
        for ids in prompts:
            engine.generate(ids, SamplingParams(max_new_tokens=max_new))
    finally:
        engine.step_observers.remove(observer)
    return observer.table()


def feature_overhead(target, width: int, reps: int = 40) -> dict:
    """Median seconds of a `width`-token verify forward with and without the EAGLE-3 features."""
    lean = LlamaTarget(target.model)
    ids = torch.randint(100, 40000, (120,), generator=torch.Generator().manual_seed(0)).tolist()
    times: dict[bool, list[float]] = {False: [], True: []}
    with torch.inference_mode():
        lean.reset(0)
        lean.forward([0], [ids[:100]], logits="last")
        for i in range(reps):
            for feats in (False, True) if i % 2 else (True, False):
                lean.rollback(0, 100)
                t = time.perf_counter()
                lean.forward([0], [ids[100 : 100 + width]], features=feats)
                times[feats].append(time.perf_counter() - t)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    return {"width": width, "ms_without": round(1000 * off, 2), "ms_with": round(1000 * on, 2),
            "extra": round(on / off - 1, 4)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--eagle", help="an Eagle3 head for the target (bench/train_eagle.py writes one)")
    ap.add_argument("--drafter", help="a model drafter dir: adds its rows and HF assisted generation with it")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--k-max", type=int, default=6, help="upper bound of the adaptive rows")
    ap.add_argument("--min-confidence", type=float, nargs="+", default=[DraftLengthConfig.min_confidence],
                    help="the adaptive rows' per-token confidence stop within k; each further value adds an "
                         "eagle adaptive row with it (an A/B in one run)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", default=str(len(PROMPTS)), help="a count of built-in prompts or a .txt file")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--out", default="bench/results/engine.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)

    target = load_model(args.target, device=args.device)
    tok, k, n = target.tokenizer, args.k, args.max_new_tokens
    gen_cfg = dict(pad_token_id=tok.pad_token_id or tok.eos_token_id)
    fixed = EngineConfig(draft=DraftLengthConfig(k=k))
    try:
        stops = [DraftLengthConfig(k=args.k_max, adaptive=True, min_confidence=c) for c in args.min_confidence]
    except ValueError as e:  # DraftLengthConfig checks its own bounds
        raise SystemExit(f"--min-confidence: {e}") from None
    adaptive = EngineConfig(draft=stops[0])
    engines = {OURS_BASE: SpeculativeEngine.for_model(target, NoDrafter())}
    hf_rows = {HF_BASE: {}, f"HF prompt lookup k={k}": dict(prompt_lookup_num_tokens=k)}
    if args.eagle:
        eagle = load_feature_drafter(args.eagle, target)
        engines[f"ours eagle k={k}"] = SpeculativeEngine.for_model(target, eagle, fixed)
        engines["ours eagle adaptive"] = SpeculativeEngine.for_model(
            target, load_feature_drafter(args.eagle, target), adaptive)
        for stop in stops[1:]:
            engines[f"ours eagle adaptive, min_confidence {stop.min_confidence}"] = SpeculativeEngine.for_model(
                target, load_feature_drafter(args.eagle, target), EngineConfig(draft=stop))
    engines[f"ours lookup k={k}"] = SpeculativeEngine.for_model(target, PromptLookupDrafter(), fixed)
    engines["ours lookup adaptive"] = SpeculativeEngine.for_model(target, PromptLookupDrafter(), adaptive)
    if args.drafter:
        drafter = load_model_drafter(Path(args.drafter), target)
        engines[f"ours model drafter k={k}"] = SpeculativeEngine.for_model(target, drafter, fixed)
        hf_rows[f"HF assisted k={k} (same model drafter)"] = dict(
            assistant_model=hf_assistant(drafter, target.vocab_size, k))
    rows: dict[str, dict] = {name: {"tps": [], "stats": []} for name in [*hf_rows, *engines]}
    prompts = [encode(tok, p, chat=True) for p in read_prompts(args.prompts)]
    load0 = os.getloadavg()[0]  # other processes on the machine skew wall-clock rows; recorded with the results
    overhead = [feature_overhead(target, w) for w in (1, k + 1)]
    print(f"EAGLE-3 features in a verify forward: {overhead}", flush=True)
    # Warm-up: first calls pay for allocator and kernel selection (and adaptive rows measure their costs).
    hf_row(target.model, prompts[0], 8, **gen_cfg)
    for eng in engines.values():
        eng.generate(prompts[0], SamplingParams(max_new_tokens=16))
    for i, ids in enumerate(prompts):
        ref = None
        for name, kw in hf_rows.items():
            out, dt = hf_row(target.model, ids, n, **gen_cfg, **kw)
            ref = ref or out
            rows[name]["tps"].append(len(out) / dt)
            rows[name].setdefault("match", []).append(out == ref)
        for name, eng in engines.items():
            out, dt, st = ours_row(eng, ids, n)
            rows[name]["tps"].append(len(out) / dt)
            rows[name]["stats"].append(st)
            rows[name].setdefault("match", []).append(out == ref)
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)

    calib = []
    if args.eagle:  # the fixed-k row's head again (its requests are all done), at k_max
        engine = SpeculativeEngine.for_model(target, eagle, EngineConfig(draft=DraftLengthConfig(k=args.k_max)))
        calib = calibration(engine, prompts, n)
    base, ours_base = statistics.median(rows[HF_BASE]["tps"]), statistics.median(rows[OURS_BASE]["tps"])
    step_s = 1.0 / ours_base  # one target step (our target-only seconds per token)
    table = []
    for name, r in rows.items():
        med = statistics.median(r["tps"])
        st = RequestStats.total(r["stats"]) if r["stats"] else None
        drafting = st is not None and st.drafted > 0
        table.append({
            "row": name, "tokens_per_s": round(med, 2), "ratio_vs_hf": round(med / base, 3),
            "ratio_vs_ours_target_only": round(med / ours_base, 3),
            "mean_acceptance_length": round(st.mean_acceptance_length, 3) if drafting else None,
            "acceptance_rate": round(st.acceptance_rate, 3) if drafting else None,
            "drafted_per_step": round(st.drafted / st.steps, 2) if drafting else None,
            "draft_cost_per_token_vs_target_step": round(st.draft_s / st.drafted / step_s, 4) if drafting else None,
            "draft_ms_per_step": round(1000 * st.draft_s / st.steps, 2) if st and st.steps else None,
            "verify_ms_per_step": round(1000 * st.verify_s / st.steps, 2) if st and st.steps else None,
            "outputs_equal_hf_greedy": all(r["match"]),
        })
    meta = {"target": target.model_id, "eagle": args.eagle, "model_drafter": args.drafter, "k": k,
            "k_max_adaptive": args.k_max, "min_confidence": args.min_confidence, "max_new_tokens": n,
            "prompts": len(prompts), "device": args.device,
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "loadavg_1min_start_end": [round(load0, 2), round(os.getloadavg()[0], 2)],
            "feature_overhead": overhead}
    print(f"\n{meta}\n")
    print("| row | tokens/s (median) | × HF target-only | × ours target-only | mean acc. length | acc. rate "
          "| draft tokens / step | draft cost / token (× target step) | draft / verify ms per step "
          "| outputs = HF greedy |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for t in table:
        split = f"{t['draft_ms_per_step']} / {t['verify_ms_per_step']}" if t["verify_ms_per_step"] else "—"
        cells = [t["mean_acceptance_length"], t["acceptance_rate"], t["drafted_per_step"],
                 t["draft_cost_per_token_vs_target_step"]]
        print(f"| {t['row']} | {t['tokens_per_s']} | {t['ratio_vs_hf']} | {t['ratio_vs_ours_target_only']} | "
              + " | ".join("—" if c is None else str(c) for c in cells)
              + f" | {split} | {t['outputs_equal_hf_greedy']} |")
    if calib:
        print(f"\nEAGLE-3 head's confidence vs acceptance (k = {args.k_max}, every drafted position reached):\n")
        print("| top probability | positions | accepted |")
        print("|---|---|---|")
        for c in calib:
            print(f"| {c['confidence']} | {c['positions']} | {c['accepted']} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": table, "calibration": calib}, indent=2))


if __name__ == "__main__":
    main()
