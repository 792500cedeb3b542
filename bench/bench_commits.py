"""Two commits of livedraft side by side: did a change make decoding slower?

Each commit is checked out once into a git worktree under --workdir (outside the repo) and run
with this checkout's Python environment, its own sources first on PYTHONPATH, as one worker
process per commit (bench/commit_worker.py: the target is loaded once, a warm-up request runs
before anything is timed). For every case (a `livedraft generate` command line) and every
repetition, each commit runs the same command once, in alternating order from one repetition to
the next, so machine drift hits both alike; tokens/s is the command's own summary (output
tokens over decode wall time). The table gives each commit's median tokens/s per case and the ratio new / old, per
repetition and as a median; outputs are compared for equality (greedy decoding must not change).

    python -m bench.bench_commits --old 903d78f --new HEAD --reps 5 \\
        --prompts bench/prompts/heldout-pool-12.jsonl --max-new-tokens 48 \\
        --case "target alone=--drafter-kind none" \\
        --case "eagle k 4=--drafter DIR --k 4" --case "eagle adaptive=--drafter DIR --adaptive"
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worktree(commit: str, workdir: Path) -> tuple[str, Path]:
    """(full sha, a checkout of it): `git worktree add --detach`, reused when present."""
    sha = subprocess.check_output(["git", "-C", str(REPO), "rev-parse", "--verify", f"{commit}^{{commit}}"],
                                  text=True).strip()
    path = workdir / sha[:12]
    if not (path / "online").is_dir():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--force", str(path), sha],
                       check=True, capture_output=True)
    return sha, path


class Side:
    """A worker process (bench/commit_worker.py) running `livedraft generate` from one checkout."""

    def __init__(self, tree: Path, threads: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(threads)}
        self.tree = tree
        self.proc = subprocess.Popen([sys.executable, str(REPO / "bench" / "commit_worker.py")], cwd=tree, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, argv: list[str]) -> tuple[float, list[list[int]]]:
        """(tokens/s, output ids per prompt) of `livedraft generate ARGV` on this side."""
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.tree.name}: the worker exited ({self.proc.wait()}) on {' '.join(argv)}")
        res = json.loads(line)
        if res["rc"] != 0 or res["summary"] is None:
            raise SystemExit(f"{self.tree.name}: livedraft generate {' '.join(argv)} failed (exit {res['rc']})")
        return res["summary"]["tokens_per_s"], res["outputs"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="the commit before the change")
    ap.add_argument("--new", default="HEAD", help="the commit after it (default HEAD)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--prompts", required=True, help="a prompts file `livedraft generate --prompts` reads")
    ap.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--case", action="append", required=True,
                    help="NAME=ARGS: a case's name (no \"=\" in it) and its extra `livedraft generate` arguments")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fresh", action="store_true",
                    help="new worker processes every repetition (a process's placement can bias all its runs)")
    ap.add_argument("--workdir", default="/tmp/livedraft-bench-commits", help="where the worktrees go")
    ap.add_argument("--json-out", help="also write the results here")
    args = ap.parse_args(argv)
    if args.reps < 1:
        raise SystemExit("--reps must be >= 1")
    cases = []
    for spec in args.case:
        name, sep, rest = spec.partition("=")
        if not sep or not name.strip():
            raise SystemExit(f"--case must be NAME=ARGS, got {spec!r}")
        cases.append((name.strip(), rest.split()))
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    trees = dict(zip(("old", "new"), (worktree(c, workdir) for c in (args.old, args.new)), strict=True))
    common = ["--target", args.target, "--prompts", args.prompts, "--max-new-tokens", str(args.max_new_tokens)]
    common += ["--chat"] if args.chat else []
    print(f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cpus, load average "
          f"{os.getloadavg()[0]:.1f}; old {trees['old'][0][:12]}, new {trees['new'][0][:12]}", flush=True)
    warmup = ["--target", args.target, "--prompts", args.prompts, "--max-new-tokens", "4", "--drafter-kind", "none"]

    def start_sides() -> dict[str, Side]:
        sides = {side: Side(tree, args.threads) for side, (_, tree) in trees.items()}
        for side in sides.values():  # load the target and warm the kernels before anything is timed
            side.run(warmup)
        return sides

    sides = start_sides()
    results = []
    for name, case in cases:
        tps: dict[str, list[float]] = {"old": [], "new": []}
        same = True
        for rep in range(args.reps):
            if args.fresh and (rep or results):
                for side in sides.values():
                    side.close()
                sides = start_sides()
            order = ("old", "new") if rep % 2 == 0 else ("new", "old")
            outs = {}
            for side in order:
                t, outs[side] = sides[side].run(common + case)
                tps[side].append(t)
            same &= outs["old"] == outs["new"]
            print(f"{name} rep {rep + 1}: old {tps['old'][-1]:.2f}, new {tps['new'][-1]:.2f} tokens/s", flush=True)
        ratios = [n / o for n, o in zip(tps["new"], tps["old"], strict=True)]
        results.append({"case": name, "args": " ".join(case), "old_tokens_per_s": tps["old"],
                        "new_tokens_per_s": tps["new"], "ratios": ratios, "median_ratio": statistics.median(ratios),
                        "outputs_equal": same})
    for side in sides.values():
        side.close()
    print("\n| case | old tokens/s (median) | new tokens/s (median) | new / old per repetition | median | "
          "outputs equal |\n|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['case']} | {statistics.median(r['old_tokens_per_s']):.2f} | "
              f"{statistics.median(r['new_tokens_per_s']):.2f} | {' '.join(f'{x:.3f}' for x in r['ratios'])} | "
              f"{r['median_ratio']:.3f} | {'yes' if r['outputs_equal'] else 'NO'} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"old": trees["old"][0], "new": trees["new"][0],
                                                   "results": results}, indent=1))
    return 0 if all(r["outputs_equal"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
