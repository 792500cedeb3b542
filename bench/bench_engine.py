"""Engine benchmark: ours vs Hugging Face generate, side by side in one process.

Rows (same prompts, greedy, same max_new_tokens): HF target-only `generate`,
our engine with NoDrafter, our engine with a model drafter (fixed k and
adaptive; also with the drafter on the Hugging Face forward instead of
runtime/fast_llama.py, to show what the lean forward buys), HF assisted
generation with the SAME drafter and k (`assistant_model=`, its generation
config set to `num_assistant_tokens=k`, schedule "constant", confidence
threshold 0 — transformers reads these from the assistant's own
generation_config, not from generate() kwargs), HF prompt lookup
(`prompt_lookup_num_tokens=`), and our lookup drafter. A VocabTrim drafter is
given to HF behind a head that scatters its kept rows into the full vocabulary
(-inf elsewhere), so HF drafts the same tokens at the same matmul cost.
For each prompt every row runs back to back (interleaved, so machine drift hits
all rows alike); the table reports the median over prompts of tokens/s, its
ratio to HF target-only, and acceptance statistics.

    python bench/bench_engine.py --target smollm2-135m --drafter DIR --k 4 --prompts 8 --max-new-tokens 64
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
from runtime.derive import derive_drafter
from runtime.drafters.factory import load_model_drafter
from runtime.drafters.lookup import PromptLookupDrafter
from runtime.drafters.model import ModelDrafter
from runtime.drafters.none import NoDrafter
from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine
from runtime.loader import load_model
from runtime.stats import RequestStats

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


def read_prompts(spec: str) -> list[str]:
    """`--prompts`: a count of the built-in prompts, or a prompts file as `livedraft generate` reads it."""
    return PROMPTS[: int(spec)] if spec.isdigit() else generate.read_prompts(spec)


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", help="drafter dir (default: derive one with --layers)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--k", type=int, default=4)
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
    ddir = Path(args.drafter) if args.drafter else derive_drafter(target, args.layers, Path("bench/results/drafter"))
    drafter = load_model_drafter(ddir, target)
    hf_forward_drafter = ModelDrafter(drafter.model, drafter.target_vocab_size,
                                      None if drafter.kept_ids is None else drafter.kept_ids.tolist(),
                                      version=drafter.version, fast=False)
    tok, k, n = target.tokenizer, args.k, args.max_new_tokens
    gen_cfg = dict(pad_token_id=tok.pad_token_id or tok.eos_token_id)
    fixed = EngineConfig(draft=DraftLengthConfig(k=k))
    engines = {
        "ours NoDrafter": SpeculativeEngine.for_model(target, NoDrafter()),
        f"ours model drafter k={k}": SpeculativeEngine.for_model(target, drafter, fixed),
        f"ours model drafter k={k}, HF-forward drafter": SpeculativeEngine.for_model(target, hf_forward_drafter, fixed),
        "ours model drafter adaptive": SpeculativeEngine.for_model(
            target, drafter, EngineConfig(draft=DraftLengthConfig(k=2 * k, adaptive=True))),
        f"ours lookup k={k}": SpeculativeEngine.for_model(target, PromptLookupDrafter(), fixed),
    }
    hf_rows = {
        "HF generate (target only)": {},
        f"HF assisted k={k} (same drafter)": dict(assistant_model=hf_assistant(drafter, target.vocab_size, k)),
        f"HF prompt lookup k={k}": dict(prompt_lookup_num_tokens=k),
    }
    rows: dict[str, dict] = {name: {"tps": [], "stats": []} for name in [*hf_rows, *engines]}
    prompts = [encode(tok, p, chat=True) for p in read_prompts(args.prompts)]
    load0 = os.getloadavg()[0]  # other processes on the machine skew wall-clock rows; recorded with the results
    # Warm-up: first calls pay for allocator and kernel selection.
    hf_row(target.model, prompts[0], 8, **gen_cfg)
    engines["ours NoDrafter"].generate(prompts[0], SamplingParams(max_new_tokens=8))
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

    base = statistics.median(rows["HF generate (target only)"]["tps"])
    table = []
    for name, r in rows.items():
        med = statistics.median(r["tps"])
        st = RequestStats.total(r["stats"]) if r["stats"] else None
        table.append({
            "row": name, "tokens_per_s": round(med, 2), "ratio_vs_hf": round(med / base, 3),
            "mean_acceptance_length": round(st.mean_acceptance_length, 3) if st else None,
            "acceptance_rate": round(st.acceptance_rate, 3) if st else None,
            "draft_s": round(st.draft_s, 2) if st else None, "verify_s": round(st.verify_s, 2) if st else None,
            "draft_ms_per_step": round(1000 * st.draft_s / st.steps, 1) if st and st.steps else None,
            "verify_ms_per_step": round(1000 * st.verify_s / st.steps, 1) if st and st.steps else None,
            "outputs_equal_hf_greedy": all(r["match"]),
        })
    meta = {"target": target.model_id, "drafter": str(ddir), "drafter_version": drafter.version,
            "drafter_head_rows": None if drafter.kept_ids is None else len(drafter.kept_ids), "k": k,
            "max_new_tokens": n, "prompts": len(prompts), "device": args.device,
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "loadavg_1min_start_end": [round(load0, 2), round(os.getloadavg()[0], 2)]}
    print(f"\n{meta}\n")
    print("| row | tokens/s (median) | × HF target-only | mean acc. length | acc. rate | draft / verify ms per step "
          "| outputs = HF greedy |")
    print("|---|---|---|---|---|---|---|")
    for t in table:
        split = f"{t['draft_ms_per_step']} / {t['verify_ms_per_step']}" if t["verify_ms_per_step"] else "—"
        print(f"| {t['row']} | {t['tokens_per_s']} | {t['ratio_vs_hf']} | {t['mean_acceptance_length'] or '—'} | "
              f"{t['acceptance_rate'] if t['acceptance_rate'] is not None else '—'} | {split} | "
              f"{t['outputs_equal_hf_greedy']} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": table}, indent=2))


if __name__ == "__main__":
    main()
