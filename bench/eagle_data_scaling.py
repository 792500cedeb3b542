"""EAGLE-3 warm start against its data: acceptance on prompts unlike the training pool, at a fixed
step budget, as the number of distinct training prompts grows.

Training sets, each trained from a new head for `--steps` steps (or `--minutes`) with the warm
start's settings (`online.trainer.warmstart.warm_start`, as bench/train_eagle.py):

- `pool×(1+S)`: the current recipe's data: `--pool` general-pool prompts, answered greedily and
  `--sampled` more times sampled at `--temperature`;
- `magpie N`, for each N in `--magpie`: N distinct prompts the target writes itself (Magpie,
  `synthesize_prompts`), answered greedily; the sets are nested (the first N of the largest);
- `pool×(1+S) + magpie N`: both, N the largest.

Each head is replayed teacher-forced at draft length `--k`, greedy, on three held-out sets: `--heldout`
further general-pool prompts (like the pool's templates), the engine benchmark's 8 prompts and
`--unlike` (a prompts file in no pool; bench/prompts/unlike-40.jsonl by default), the last also every
`--eval-every` steps (the curve). The answers are written to `--out`/data.jsonl.gz and reused by a
rerun with the same data settings, so a run on a fast machine can hand its data to a CPU run
(`--data-only` stops after making them). A rerun with other `--magpie` sizes up to the written
largest reuses them too. Results: `--out`/scaling.json and a Markdown table.

    python -m bench.eagle_data_scaling --magpie 1000,2000,4000 --steps 2555 --out bench/results/scaling
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from bench.bench_engine import PROMPTS
from bench.traffic import THREADS_HELP, chat_ids, prompt_pool, start_run
from bench.train_eagle import replay_heldout
from online.commands.generate import read_prompts
from online.config import MIXED_PRECISION, TrainerConfig
from online.stream.events import trace_from_json, trace_to_json
from online.trainer.warmstart import answer_prompts, sampled_answers, synthesize_prompts, warm_start
from runtime.loader import DTYPES, load_model, resolve_device
from runtime.trace import RequestTrace

DATA_KEYS = ("target", "pool", "heldout", "sampled", "temperature", "max_new_tokens", "unlike")
DATA_TAGS = ("pool", "magpie", "heldout", "bench", "unlike")  # the sets of a data file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m", help="a packaged name, a model directory or a .gguf file")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    ap.add_argument("--pool", type=int, default=700, help="general-pool training prompts of the pool set")
    ap.add_argument("--sampled", type=int, default=2, help="sampled answers per pool prompt, beside the greedy one")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--magpie", default="1000,2000,4000", help="comma-separated counts of target-written prompts")
    ap.add_argument("--heldout", type=int, default=50, help="held-out general-pool prompts")
    ap.add_argument("--unlike", default="bench/prompts/unlike-40.jsonl", help="held-out prompts in no pool")
    ap.add_argument("--magpie-topics", default="",
                    help="a file of topics, one a line (# comments): the written prompts take them in turn, each "
                         "written after a system turn naming its topic (per-domain Magpie seeds; "
                         "bench/prompts/topics-dewey.txt: the Dewey Decimal divisions); default: unseeded")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--answer-batch", type=int, default=16, help="requests the target answers at a time")
    ap.add_argument("--answer-dtype", choices=tuple(DTYPES), default="float32",
                    help="dtype of the target copy that writes the prompts and answers the training sets (bfloat16: "
                         "about twice as fast on a CPU with AMX; its answers are another greedy path where two "
                         "tokens nearly tie); the held-out sets are always answered by the target as loaded")
    ap.add_argument("--steps", type=int, default=2555,
                    help="training steps per head (2,555: what 30 minutes bought on the 2-core Xeon, bf16)")
    ap.add_argument("--minutes", type=float, default=0.0, help="a training time budget per head instead (0: none)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--prompt-weight", type=float, default=TrainerConfig.prompt_weight,
                    help="loss weight of prompt positions (output positions weigh 1)")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--mixed-precision", choices=MIXED_PRECISION, default="bf16")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--sets", default="", help="comma-separated names of the sets to train (default: all)")
    ap.add_argument("--threads", type=int, default=2, help=THREADS_HELP)
    ap.add_argument("--out", default="bench/results/eagle-scaling")
    ap.add_argument("--data-only", action="store_true", help="make (or check) the answers, then stop")
    ap.add_argument("--data", help="answers another run wrote (its data.jsonl.gz), made with the same settings by "
                                   "the same model under another name or on another device (a GPU's greedy "
                                   "answers may differ from a CPU's where two tokens nearly tie)")
    args = ap.parse_args()
    sizes = sorted({int(x) for x in args.magpie.split(",") if x.strip()})
    if args.pool <= 0 and not sizes:
        raise SystemExit("nothing to train on: give --pool > 0 or --magpie counts")
    if any(n <= 0 for n in sizes) or args.heldout <= 0 or args.steps <= 0:
        raise SystemExit("--magpie counts, --heldout and --steps must be positive")
    out, work = start_run(args)
    out.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()[0]
    device = resolve_device(args.device)
    target = load_model(args.target, device=device)
    t0 = time.perf_counter()
    data = make_data(target, args, sizes[-1] if sizes else 0, Path(args.data) if args.data else out / "data.jsonl.gz",
                     made_elsewhere=bool(args.data))
    gen_s = time.perf_counter() - t0
    print(f"data: {sum(len(v) for v in data.values())} traces ({gen_s:.0f}s)", flush=True)
    if args.data_only:
        return
    pool_name = f"pool×{1 + args.sampled}"
    sets = {}
    if args.pool:
        sets[pool_name] = data["pool"]
    for n in sizes:
        sets[f"magpie {n}"] = data["magpie"][:n]
    if args.pool and sizes:
        sets[f"{pool_name} + magpie {sizes[-1]}"] = data["pool"] + data["magpie"][: sizes[-1]]
    if args.sets:
        wanted = [s.strip() for s in args.sets.split(",")]
        unknown = [s for s in wanted if s not in sets]
        if unknown:
            raise SystemExit(f"--sets: unknown {unknown}; choose from {list(sets)}")
        sets = {s: sets[s] for s in wanted}
    cfg = TrainerConfig(steps=args.steps, max_seconds=args.minutes * 60, batch_size=args.batch_size, lr=args.lr,
                        ce_weight=0.2, warmup_steps=20, draft_vocab=args.draft_vocab,
                        prompt_weight=args.prompt_weight,
                        mixed_precision=args.mixed_precision)
    rows = []
    summary = {"target": target.model_id, "device": device, "answer_dtype": args.answer_dtype,
               "data_seconds": round(gen_s, 1), "k": args.k,
               "steps": args.steps, "minutes": args.minutes, "batch_size": args.batch_size, "lr": args.lr,
               "prompt_weight": args.prompt_weight,
               "mixed_precision": args.mixed_precision, "rows": rows}
    for name, train in sets.items():
        head_dir = work / name.replace(" ", "_").replace("×", "x").replace("+", "and")

        def progress(event: str, d: dict, name: str = name) -> None:
            if event == "eval":
                print(f"  {name}: step {d['step']:5d}  train {d['train_seconds']:6.0f}s  unlike MAL "
                      f"{d['heldout_mean_acceptance_length']:.3f}", flush=True)

        res = warm_start(target, train, data["unlike"], head_dir, cfg, k=args.k, eval_every=args.eval_every,
                         version=name, on_progress=progress)
        row = {"set": name, "prompts": len({tuple(t.prompt_ids) for t in train}), "traces": len(train),
               "tokens": sum(len(t.output_ids) for t in train), "steps": res.steps,
               "train_seconds": round(res.train_seconds, 1), "feature_seconds": round(res.feature_seconds, 1),
               "unlike": res.curve[-1].heldout_mean_acceptance_length,
               "unlike_first_token": res.curve[-1].heldout_first_token_acceptance,
               "bench8": replay_heldout(target, head_dir, data["bench"], args.k)["mean_acceptance_length"],
               "bench8_per_prompt": [replay_heldout(target, head_dir, [t], args.k)["mean_acceptance_length"]
                                     for t in data["bench"]],
               "pool_heldout": replay_heldout(target, head_dir, data["heldout"], args.k)["mean_acceptance_length"],
               "unlike_curve": [(p.step, p.heldout_mean_acceptance_length) for p in res.curve]}
        rows.append(row)
        print(f"{name}: {row}", flush=True)
        summary["loadavg_1min_start_end"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
        (out / "scaling.json").write_text(json.dumps(summary, indent=2))
    budget = f"{args.minutes:g} minutes of training (at most {args.steps} steps)" if args.minutes \
        else f"{args.steps} steps"
    print(f"\n{budget} per head, batch {args.batch_size}, {args.mixed_precision}, k = {args.k}, "
          f"{target.model_id} on {device}:\n")
    print(f"| training set | distinct prompts | traces | answer tokens | steps | MAL, {len(data['unlike'])} unlike "
          "prompts | first-token acc. (unlike) | MAL, engine bench's 8 | MAL, held-out pool |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['set']} | {r['prompts']} | {r['traces']} | {r['tokens']} | {r['steps']} | {r['unlike']:.3f} | "
              f"{r['unlike_first_token']:.3f} | {r['bench8']:.3f} | {r['pool_heldout']:.3f} |")
    print(f"\nMAL on each of the engine bench's {len(PROMPTS)} prompts (its answer's tokens):\n")
    print("| prompt | tokens | " + " | ".join(r["set"] for r in rows) + " |")
    print("|---|---|" + "---|" * len(rows))
    for i, (prompt, t) in enumerate(zip(PROMPTS, data["bench"], strict=True)):
        short = prompt.splitlines()[0][:48]
        cells = " | ".join(f"{r['bench8_per_prompt'][i]:.3f}" for r in rows)
        print(f"| {short} | {len(t.output_ids)} | {cells} |")


def read_topics(path: str) -> list[str]:
    """The topics of a `--magpie-topics` file: its non-blank lines, `#` comments left out, each once."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise SystemExit(f"--magpie-topics {path}: {e.strerror or e}") from None
    topics = list(dict.fromkeys(s for line in lines if (s := line.strip()) and not s.startswith("#")))
    if not topics:
        raise SystemExit(f"--magpie-topics {path}: no topics in it (one a line)")
    return topics


def read_data(path: Path) -> dict[str, list[RequestTrace]]:
    """The answers of a data file this bench wrote (`make_data`), by set (`DATA_TAGS`)."""
    with gzip.open(path, "rt") as f:
        f.readline()  # the key it was made with
        traces = [trace_from_json(line) for line in f]
    return {tag: [t for t in traces if t.tag == tag] for tag in DATA_TAGS}


def make_data(target, args, magpie: int, path: Path, *, made_elsewhere: bool = False) -> dict[str, list[RequestTrace]]:
    """The answers by set (`DATA_TAGS`), from `path` when it was
    made with the same settings and at least `magpie` written prompts, else made and written there.
    `made_elsewhere`: `path` must hold them (its target may carry another name), else SystemExit."""
    key = {k: getattr(args, k) for k in DATA_KEYS}
    if getattr(args, "answer_dtype", "float32") != "float32":  # keyed only where not the default: old files stay valid
        key["answer_dtype"] = args.answer_dtype
    topics = read_topics(args.magpie_topics) if getattr(args, "magpie_topics", "") else []
    if topics:
        key["magpie_topics"] = topics
    if made_elsewhere:
        if not path.is_file():
            raise SystemExit(f"--data {path}: no such file")
        with gzip.open(path, "rt") as f:
            head = json.loads(f.readline())
        theirs, ours = ({k: v for k, v in d.items() if k != "target"} for d in (head["key"], key))
        if theirs != ours or head["magpie"] < magpie:
            raise SystemExit(f"--data {path} was made with {head}: give the same settings (and --magpie up to "
                             f"{head['magpie']})")
        print(f"answers made by {head['key']['target']} (this run: {args.target})", flush=True)
        key = head["key"]
    if path.is_file():
        with gzip.open(path, "rt") as f:
            head = json.loads(f.readline())
        if head["key"] == key and head["magpie"] >= magpie:
            print(f"answers from {path}", flush=True)
            return read_data(path)
    t0 = time.perf_counter()

    def done(what: str) -> Callable[[int], None]:
        count = [0]

        def on(n: int) -> None:
            count[0] += n
            print(f"  {what}: {count[0]} ({time.perf_counter() - t0:.0f}s)", flush=True)
        return on

    pool = prompt_pool("general", args.pool + args.heldout, seed=1)
    if len(set(pool)) != len(pool):
        raise SystemExit(f"the general pool has fewer than {len(pool)} distinct prompts: lower --pool/--heldout")
    unlike = read_prompts(args.unlike)
    held = set(pool) | set(PROMPTS) | set(unlike)
    writer = target if args.answer_dtype == "float32" else load_model(args.target, dtype=DTYPES[args.answer_dtype],
                                                                      device=str(target.model.device))
    written = [p for p in synthesize_prompts(writer, magpie + 64, seed=11, batch=args.answer_batch, topics=topics,
                                             progress=done("prompts written"))
               if p not in held][:magpie] if magpie else []
    if len(written) < magpie:
        raise SystemExit(f"the target wrote {len(written)} new prompts, {magpie} asked for")
    print(f"  {len(written)} prompts written ({time.perf_counter() - t0:.0f}s)", flush=True)
    ids = {"pool": [chat_ids(target, p) for p in pool[: args.pool]],
           "magpie": [chat_ids(target, p) for p in written],
           "heldout": [chat_ids(target, p) for p in pool[args.pool:]],
           "bench": [chat_ids(target, p) for p in PROMPTS],
           "unlike": [chat_ids(target, p) for p in unlike]}
    data = {tag: answer_prompts(writer if tag in ("pool", "magpie") else target, p, args.max_new_tokens,
                                batch=args.answer_batch, progress=done(tag))
            for tag, p in ids.items()}
    data["pool"] += sampled_answers(writer, ids["pool"], args.max_new_tokens, args.sampled, args.temperature,
                                    batch=args.answer_batch, progress=done("pool, sampled"))
    for tag, traces in data.items():
        for t in traces:
            t.tag = tag
    tmp = path.with_suffix(".tmp")
    with gzip.open(tmp, "wt") as f:
        f.write(json.dumps({"key": key, "magpie": magpie}) + "\n")
        for traces in data.values():
            f.writelines(trace_to_json(t) + "\n" for t in traces)
    tmp.replace(path)
    return data


if __name__ == "__main__":
    main()
