"""llama-server's decoding step, the target alone and with an EAGLE-3 head drafting n tokens, with flash
attention on and off, after prompts of several lengths: what `[engine] flash_attn = "auto"` measures
and the step-cost ratios C(n) the cost rule (`runtime/llamacpp/costs.py`) prices drafting with.

Each configuration (flash attention on / off × the target alone / the head at n-max n, p-min 0, which
drafts n tokens every step) is a llama-server process of its own, started in turn, `--rounds` times
over (machine drift hits every configuration alike). A measurement is the median over `--requests`
requests (after one per process that warms it up) of llama-server's own generation time per decoding step, for
`--tokens` tokens after a prompt of `--contexts` ids; the table gives the median over the rounds.
A head that is never right drafts as much as one that always is, so the step costs do not depend on
the head's training (default: an untrained head of the target's shape).

    python -m bench.bench_llama_steps --threads 1 --contexts 64,512,1500
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from bench.bench_do_no_harm import cpu
from online.config import load_config
from online.serving.llama import UpstreamFactory, head_gguf, resolve_llama_target
from runtime.llamacpp.costs import step_seconds
from runtime.llamacpp.upstream import SpecParams, Upstream


def untrained_head(target: str, out: Path) -> Path:
    """A new EAGLE-3 head for `target`, saved under `out`."""
    from online.trainer.eagle import choose_draft_vocab, init_head, save_head
    from runtime.loader import load_model

    model = load_model(target)
    save_head(init_head(model, choose_draft_vocab(model, 8192, [])), out, {"version": "untrained"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--head", help="an EAGLE-3 head directory (default: an untrained head of the target's shape)")
    ap.add_argument("--llama-server", help="the binary (default: as `livedraft serve` finds it)")
    ap.add_argument("--threads", type=int, default=1, help="-t / -tb (1: what `up` gives llama-server beside the "
                                                           "trainer)")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--ctx-per-slot", type=int, default=2048)
    ap.add_argument("--contexts", default="64,512,1500", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--n", default="1,4", help="draft lengths, comma-separated")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    drafts = [int(n) for n in args.n.split(",")]
    if any(c + args.tokens > args.ctx_per_slot for c in contexts) or any(n < 1 for n in drafts):
        raise SystemExit("every context plus --tokens must fit --ctx-per-slot, and draft lengths must be >= 1")

    cfg = load_config()
    cfg.engine.threads, cfg.engine.parallel, cfg.engine.ctx_per_slot = args.threads, args.parallel, args.ctx_per_slot
    cfg.engine.target_type, cfg.engine.flash_attn = "f32", "on"  # every launch below sets -fa itself
    target = resolve_llama_target(args.target, cfg)  # an f32 GGUF where llama.cpp's converter is installed
    factory = UpstreamFactory(cfg, target, binary=args.llama_server)
    tmp = Path(tempfile.mkdtemp(prefix="llama-steps-"))  # the untrained head and its GGUF, removed at exit
    atexit.register(shutil.rmtree, tmp, True)
    head = head_gguf(Path(args.head) if args.head else untrained_head(args.target, tmp / "untrained"), target)

    configs = {(fa, n): dataclasses.replace(factory.launch(head if n else None, SpecParams(n, 0.0)), flash_attn=fa)
               for fa in ("on", "off") for n in [0, *drafts]}
    ms: dict[tuple[str, int, int], list[float]] = {}
    for r in range(args.rounds):
        for (fa, n), launch in configs.items():
            up = Upstream(launch, version=f"steps-fa-{fa}-n{n}").start(cfg.engine.start_timeout_s)
            try:
                step_seconds(up, args.tokens, list(range(100, 100 + contexts[0])))  # warms the process up
                for c in contexts:
                    prompt = list(range(100, 100 + c))
                    runs = [step_seconds(up, args.tokens, prompt) for _ in range(args.requests)]
                    ms.setdefault((fa, n, c), []).append(1000 * statistics.median(runs))
            finally:
                up.stop()
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    med = {k: statistics.median(v) for k, v in ms.items()}
    print(f"\nmachine: {cpu()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; llama-server "
          f"{factory.binary}; {target.gguf.name}; {args.threads} thread(s), -np {args.parallel}; "
          f"{args.tokens} tokens a request, median of {args.requests} requests, median of {args.rounds} rounds\n")
    cols = " | ".join(f"n = {n}: ms (C({n}))" for n in drafts)
    print(f"| context | flash attention | target alone: ms a step | {cols} |")
    print("|---|---|---|" + "---|" * len(drafts))
    for c in contexts:
        for fa in ("on", "off"):
            alone = med[(fa, 0, c)]
            cells = " | ".join(f"{med[(fa, n, c)]:.1f} ({med[(fa, n, c)] / alone:.2f})" for n in drafts)
            print(f"| {c} | {fa} | {alone:.1f} | {cells} |")
    print("\nflash attention off against on, the same configuration: "
          + "; ".join(f"context {c}: alone {med[('off', 0, c)] / med[('on', 0, c)]:.2f}x, "
                      + ", ".join(f"n = {n} {med[('off', n, c)] / med[('on', n, c)]:.2f}x" for n in drafts)
                      for c in contexts))


if __name__ == "__main__":
    main()
