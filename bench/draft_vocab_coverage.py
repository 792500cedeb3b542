"""How much of the target's held-out answers a draft vocabulary chosen from the training data
covers, and the mean acceptance length a perfect head restricted to it could reach.

A new EAGLE-3 head drafts only from its draft vocabulary (`online.trainer.eagle.choose_draft_vocab`:
the training outputs' most frequent tokens), so a target token outside it is a certain rejection.
For each `--sizes` entry this chooses the vocabulary from the training set's outputs as
`warm_start` does, and reports, per held-out set of a `bench/eagle_data_scaling.py` data file:

- coverage: the share of answer tokens in the vocabulary;
- the cap: teacher-forced, greedy, at draft length `--k`, the mean acceptance length of an oracle
  that drafts the target's own next tokens while they are in the vocabulary (each step accepts
  the in-vocabulary prefix of the next k tokens, plus the target's token). With the whole
  vocabulary it is the k-step maximum; the gap below it is what the vocabulary alone costs.

No model runs beyond loading the target's tokenizer facts; seconds on a data file of 8,000 traces.

    python -m bench.draft_vocab_coverage --data bench/results/scaling-w6000/data.jsonl.gz
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from bench.eagle_data_scaling import read_data
from online.trainer.eagle import choose_draft_vocab
from runtime.loader import load_model
from runtime.trace import RequestTrace

HELD_OUT = {"unlike": "unlike prompts", "bench": "engine bench's prompts", "heldout": "held-out pool"}


def oracle_steps(output: Sequence[int], vocab: set[int] | None, k: int, *, stopped: bool = False,
                 max_new_tokens: int = 0) -> tuple[int, int]:
    """(verify steps, accepted drafts) of an oracle drafting `output` within `vocab` (None: all)
    at draft length k, as the engine replays it: the first token comes from the prefill, a draft
    leaves room for the target's token within `max_new_tokens` (0: the output's length), and an
    answer that `stopped` on its last token may end on an accepted draft."""
    budget = max(max_new_tokens, len(output))
    steps = accepted = 0
    pos = 1
    while pos < len(output):
        d = min(k, len(output) - pos - (0 if stopped else 1), budget - pos - 1)
        a = 0
        while a < d and (vocab is None or output[pos + a] in vocab):
            a += 1
        steps += 1
        accepted += a
        pos += a + (0 if pos + a == len(output) else 1)
    return steps, accepted


def oracle_counts(traces: Sequence[RequestTrace], vocab: set[int] | None, k: int) -> tuple[int, int]:
    """`oracle_steps` summed over the greedy `traces`, each replayed as it was logged."""
    steps = accepted = 0
    for t in traces:
        if t.greedy and t.output_ids:
            s, a = oracle_steps(t.output_ids, vocab, k, stopped=t.finish_reason == "stop",
                                max_new_tokens=t.max_new_tokens)
            steps, accepted = steps + s, accepted + a
    return steps, accepted


def coverage_row(traces: Sequence[RequestTrace], vocab: set[int] | None, k: int) -> tuple[float, float]:
    """(token coverage, oracle mean acceptance length) over the greedy `traces`."""
    greedy = [t for t in traces if t.greedy and t.output_ids]
    tokens = sum(len(t.output_ids) for t in greedy)
    inside = tokens if vocab is None else sum(tok in vocab for t in greedy for tok in t.output_ids)
    steps, accepted = oracle_counts(greedy, vocab, k)
    return inside / max(tokens, 1), 1.0 + accepted / max(steps, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="a data.jsonl.gz of bench.eagle_data_scaling")
    ap.add_argument("--target", default="smollm2-135m", help="the target the data was answered by")
    ap.add_argument("--sizes", default="4096,8192,16384,32768", help="comma-separated draft vocabulary sizes")
    ap.add_argument("--train", default="pool,magpie", help="comma-separated tags of the training set")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", help="also write the rows as JSON here")
    args = ap.parse_args()
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        raise SystemExit(f"--sizes: comma-separated integers, got {args.sizes!r}") from None
    if not sizes or args.k < 1:
        raise SystemExit("give at least one --sizes entry and --k >= 1")
    if not Path(args.data).is_file():
        raise SystemExit(f"--data {args.data}: no such file (make one with bench.eagle_data_scaling --data-only)")
    data = read_data(Path(args.data))
    tags = [s.strip() for s in args.train.split(",") if s.strip()]
    missing = [t for t in tags + list(HELD_OUT) if not data.get(t)]
    if missing:
        raise SystemExit(f"{args.data} has no traces tagged {missing} (it has {sorted(t for t in data if data[t])})")
    target = load_model(args.target)
    train = [t.output_ids for tag in tags for t in data[tag]]
    print(f"training set: {', '.join(f'{t} {len(data[t])}' for t in tags)} traces, "
          f"{sum(map(len, train))} answer tokens, {len({x for s in train for x in s})} distinct; "
          f"target vocabulary {target.vocab_size}; k = {args.k}")
    header = " | ".join(f"{HELD_OUT[t]} ({len(data[t])}): coverage, cap" for t in HELD_OUT)
    print(f"| draft vocabulary | {header} |")
    print("|---|" + "---|" * len(HELD_OUT))
    rows = []
    for size in sorted({min(s, target.vocab_size) for s in sizes} | {target.vocab_size}):
        vocab = None if size == target.vocab_size else set(choose_draft_vocab(target, size, train))
        cells = {t: coverage_row(data[t], vocab, args.k) for t in HELD_OUT}
        rows.append({"size": size, **{t: {"coverage": round(c, 4), "cap": round(m, 3)} for t, (c, m) in cells.items()}})
        name = f"{size}" if vocab is not None else f"{size} (all)"
        print(f"| {name} | " + " | ".join(f"{c:.2%}, {m:.3f}" for c, m in cells.values()) + " |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"data": args.data, "k": args.k, "train": tags, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
