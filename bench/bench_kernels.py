"""Step costs of our engine's target forward with and without the native kernel (runtime/native.py).

Two runners over the same model in one process, one with the native kernel among its candidates
and one without (torch's MKL and oneDNN kernels only); each repetition times, for both runners in
alternating order, a forward of n tokens after `--context` cached tokens for each n of `--tokens`.
It prints, per runner, the median one-token step and C(n) = step(n) / step(1), the cost of a
verify step of n tokens in one-token steps (what the adaptive rule weighs), and the one-token
step's ratio between the two. Every token of the two runners' greedy argmax is compared too.

    python -m bench.bench_kernels                       # SmolLM2-135M, 1 thread, n = 1 2 3 5 9
    python -m bench.bench_kernels --threads 2 --reps 21
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (serving beside the trainer: 1)")
    ap.add_argument("--context", type=int, default=100, help="cached tokens before each timed step")
    ap.add_argument("--tokens", default="1,2,3,5,9", help="tokens per timed step")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from runtime import native
    from runtime.llama import LlamaRunner
    from runtime.loader import load_model

    reason = native.unavailable_reason()
    if native.kernel() is None:
        raise SystemExit(f"bench_kernels: no native kernel on this machine: {reason or 'see the log'}")
    model = load_model(args.target).model
    ns = [int(n) for n in args.tokens.split(",")]
    if 1 not in ns:
        ns = [1, *ns]
    runners = {"native": LlamaRunner(model, native_kernel=True), "torch": LlamaRunner(model, native_kernel=False)}
    kernels = {name: sorted({k for layer in r.layers for k in layer.gate_up._choice}) for name, r in runners.items()}
    gen = torch.Generator().manual_seed(0)
    ids = [int(i) for i in torch.randint(100, 20000, (args.context + max(ns),), generator=gen)]
    caches = {name: r.new_cache(1, args.context + max(ns) + 8) for name, r in runners.items()}
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in ns} for name in runners}
    mismatches = 0
    with torch.inference_mode():
        for name, r in runners.items():
            r.forward(caches[name], [0], [ids[: args.context]], logits=None)
        for rep in range(args.reps):
            order = list(runners) if rep % 2 == 0 else list(reversed(runners))
            for n in ns:
                argmax = {}
                for name in order:
                    kv = caches[name]
                    kv.lengths[0] = args.context
                    t0 = time.perf_counter()
                    out = runners[name].forward(kv, [0], [ids[args.context : args.context + n]], logits=[n])
                    times[name][n].append(time.perf_counter() - t0)
                    argmax[name] = out.logits[0, :n].argmax(-1)
                mismatches += int((argmax["native"] != argmax["torch"]).sum())
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s); "
          f"{args.target}, {args.context} tokens of context, median of {args.reps}")
    print("| kernels | one token (ms) | " + " | ".join(f"C({n})" for n in ns if n > 1) + " |")
    print("|---|---|" + "---|" * (len(ns) - 1))
    one = {}
    for name in runners:
        one[name] = statistics.median(times[name][1])
        costs = " | ".join(f"{statistics.median(times[name][n]) / one[name]:.2f}" for n in ns if n > 1)
        label = f"{name} ({', '.join(kernels[name])} in the MLP)"
        print(f"| {label} | {one[name] * 1e3:.1f} | {costs} |")
    print(f"one-token step, torch over native: {one['torch'] / one['native']:.2f}x; "
          f"greedy tokens that differ between the two: {mismatches} of {args.reps * sum(ns)}")


if __name__ == "__main__":
    main()
