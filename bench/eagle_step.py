"""The EAGLE-3 trainer's step cost on real traces: seconds per optimizer step (median of `--steps`
after `--warmup`) at the warm start's settings (batch 8, bf16 matmuls, 3 unrolled steps, a
draft vocabulary of 8,192), on `--traces` seeded random traces of a data file that
bench/eagle_data_scaling.py wrote. The head is new and the traces' features are computed first;
only the optimizer steps are timed.

`--trees A,B` compares the trainer of two checkouts on this machine: each measurement runs in a
process of its own with that checkout first on the import path, alternating A, B, A, B ...
`--rounds` times, and the table gives each one's median and B's ratio to A.

    git worktree add /tmp/before <commit>
    python -m bench.eagle_step --data bench/results/scaling-w6000/data.jsonl.gz --trees /tmp/before,.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import inspect
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="a data.jsonl.gz bench/eagle_data_scaling.py wrote")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--traces", type=int, default=160, help="random training traces (pool and written prompts)")
    ap.add_argument("--steps", type=int, default=25, help="timed optimizer steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--mixed-precision", default="bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trees", default="", help="A,B: checkouts whose trainers are compared (default: this one only)")
    ap.add_argument("--rounds", type=int, default=2, help="with --trees: measurements of each, alternating")
    ap.add_argument("--phases", action="store_true",
                    help="also time the step's parts (soft labels, the unrolled layer, the draft loss, backward, "
                         "optimizer): mean ms a timed step, in the JSON line")
    args = ap.parse_args()
    if not Path(args.data).is_file():
        raise SystemExit(f"--data {args.data}: no such file (bench/eagle_data_scaling.py --data-only writes one)")
    if not args.trees:
        print(json.dumps(measure(args)), flush=True)
        return
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    if len(trees) != 2 or not all((t / "online" / "trainer" / "eagle.py").is_file() for t in trees):
        raise SystemExit(f"--trees {args.trees}: give two checkouts of this project, comma-separated")
    own = _drop(_drop(_drop(sys.argv[1:], "--trees"), "--rounds"), "--data")
    own += ["--data", str(Path(args.data).resolve())]  # each measurement runs in its own tree
    runs: dict[Path, list[dict]] = {t: [] for t in trees}
    for r in range(args.rounds):
        for tree in trees:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(ROOT)])}
            out = subprocess.run([sys.executable, str(Path(__file__).resolve()), *own], env=env, cwd=tree,
                                 capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"{tree}: exit {out.returncode}\n{out.stderr[-2000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            runs[tree].append(result)
            print(f"round {r + 1}, {tree}: median {result['median_s']:.3f} s a step", flush=True)
    print(f"\n{runs[trees[0]][0]['machine']}, torch {runs[trees[0]][0]['torch']}, {args.threads} threads, "
          f"{args.traces} traces, batch {args.batch_size}, {args.mixed_precision}, {args.steps} steps a measurement\n")
    print("| checkout | commit | median s a step, each measurement | median | vs the first |")
    print("|---|---|---|---|---|")
    base = statistics.median(x["median_s"] for x in runs[trees[0]])
    for tree in trees:
        each = [x["median_s"] for x in runs[tree]]
        med = statistics.median(each)
        print(f"| {tree.name} | {runs[tree][0]['commit']} | {' '.join(f'{x:.3f}' for x in each)} | **{med:.3f}** "
              f"| {med / base:.2f}× |")


def _drop(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def measure(args: argparse.Namespace) -> dict:
    import torch

    from bench.bench_do_no_harm import cpu
    from online.config import TrainerConfig
    from online.stream.events import trace_from_json
    from online.trainer.eagle import choose_draft_vocab, init_head, make_examples, train_head, usable
    from online.trainer.features import FeatureExtractor
    from runtime.loader import load_model

    torch.set_num_threads(args.threads)
    with gzip.open(args.data, "rt") as f:
        f.readline()
        traces = [t for t in map(trace_from_json, f) if t.tag in ("pool", "magpie")]
    traces = random.Random(args.seed).sample(traces, min(args.traces, len(traces)))
    target = load_model(args.target)
    traces, _ = usable(traces, target)
    cfg = TrainerConfig(steps=args.warmup + args.steps, batch_size=args.batch_size,
                        mixed_precision=args.mixed_precision, seed=args.seed)
    head = init_head(target, choose_draft_vocab(target, 8192, [t.output_ids for t in traces]), seed=args.seed)
    extractor = FeatureExtractor(target, head.config.aux_layers)
    passes = [p for i in range(0, len(traces), 64) for p in extractor(traces[i : i + 64])]
    examples = make_examples(traces, passes, cfg)
    embed, lm = target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight
    ends = [time.perf_counter()]
    phases = Phases(args.warmup) if args.phases else None

    def on_step(step: int, loss: float) -> None:
        ends.append(time.perf_counter())
        if phases is not None:
            phases.step_done()

    with phases.timing() if phases is not None else contextlib.nullcontext():
        train_head(head, examples, embed, lm, cfg, on_step=on_step)
    times = [b - a for a, b in zip(ends, ends[1:], strict=False)][args.warmup :]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"median_s": round(statistics.median(times), 4), "min_s": round(min(times), 4), "steps": len(times),
           "traces": len(traces), "machine": cpu(), "torch": torch.__version__, "commit": commit or "?"}
    if phases is not None:
        out["phases_ms"] = {**phases.means(len(times)), "step": round(statistics.fmean(times) * 1000, 1)}
    return out


class Phases:
    """Wall time of the trainer step's parts, summed over the steps after `warmup`: the soft labels,
    the unrolled layer's forward (TTTLoss._step), the draft loss's forward and backward
    (DraftLoss), the whole forward (TTTLoss), the optimizer step, and the rest of the step
    (backward but the draft loss's, zero_grad, clipping). Wrappers only: the timed code is the trainer's."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.steps, self.sums = warmup, 0, {}

    def _wrap(self, name: str, fn):
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if self.steps >= self.warmup:
                    self.sums[name] = self.sums.get(name, 0.0) + time.perf_counter() - t
        return timed

    def step_done(self) -> None:
        self.steps += 1

    @staticmethod
    def parts() -> list[tuple[object, str, str]]:
        """(owner, attribute, part name) of each timed function."""
        import torch

        from online.trainer import eagle

        return [(eagle, "soft_labels", "soft_labels"), (eagle.TTTLoss, "_step", "layer_forward"),
                (eagle.TTTLoss, "__call__", "forward"), (eagle.DraftLoss, "forward", "draft_loss_forward"),
                (eagle.DraftLoss, "backward", "draft_loss_backward"), (torch.optim.AdamW, "step", "optimizer")]

    @contextlib.contextmanager
    def timing(self):
        """Each part wrapped while inside; after, each owner's own attributes as they were (a
        staticmethod as one; an inherited one, such as AdamW's step, inherited again)."""
        parts = self.parts()
        saved = [(owner, attr, vars(owner).get(attr)) for owner, attr, _ in parts]
        for owner, attr, name in parts:
            raw = inspect.getattr_static(owner, attr)
            if isinstance(raw, staticmethod):
                setattr(owner, attr, staticmethod(self._wrap(name, raw.__func__)))
            else:
                setattr(owner, attr, self._wrap(name, raw))
        try:
            yield self
        finally:
            for owner, attr, raw in saved:
                if raw is None:
                    delattr(owner, attr)
                else:
                    setattr(owner, attr, raw)

    def means(self, steps: int) -> dict[str, float]:
        return {k: round(v / max(steps, 1) * 1000, 1) for k, v in self.sums.items()}


if __name__ == "__main__":
    main()
