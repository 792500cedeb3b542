"""Model-free drafter benchmark: suffix cache (and n-gram table) at scale, through the Python API.

Builds the global cache from synthetic traffic (default 100k sequences x 256 tokens, vocab 32k),
then replays held-out requests step by step the way the engine drives a drafter: speculate
k tokens, "verify" against the held-out truth (accept the matching prefix plus one bonus
token), append the accepted tokens. Reports microseconds per call (p50/p90/p99), per appended
token, per cached token on insert and eviction, memory (RSS growth), snapshot size and times,
and the mean acceptance length as a sanity check that the drafts are real.

Traffic mix (each sequence 256 tokens, unigram frequencies Zipf(1.1) over a shuffled vocab):
45% a popular template (1000 templates, Zipf popularity) with 12 slots filled from pools of
3-1000 fillers and 1% random substitutions; 25% a template prefix then free text; 30% free text.

    nice -n 10 python bench/bench_suffix.py           # the full 100k run (~30 min, ~9 GiB)
    python bench/bench_suffix.py --sequences 10000 --requests 100
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from runtime.drafters.ngram import NGramConfig, NGramTable
from runtime.drafters.suffix_tree import SuffixCache, SuffixConfig


class Traffic:
    """Synthetic outputs: templates with slot variations, template prefixes, free text."""

    def __init__(self, vocab: int = 32000, templates: int = 1000, length: int = 256, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.vocab, self.length = vocab, length
        p = 1.0 / np.arange(1, vocab + 1) ** 1.1
        self.cdf = np.cumsum(p / p.sum())
        self.ids = self.rng.permutation(vocab)
        self.templates = [self.text(length) for _ in range(templates)]
        pop = 1.0 / np.arange(1, templates + 1) ** 1.1
        self.pop = pop / pop.sum()
        self.slots = [np.sort(self.rng.choice(length, 12, replace=False)) for _ in range(templates)]
        self.pools = [[self._pool() for _ in range(12)] for _ in range(templates)]

    def text(self, n: int) -> np.ndarray:
        return self.ids[np.searchsorted(self.cdf, self.rng.random(n))]

    def _pool(self) -> list[np.ndarray]:
        size = int(self.rng.choice([3, 10, 50, 1000]))
        return [self.text(int(self.rng.integers(1, 4))) for _ in range(size)]

    def sequence(self) -> list[int]:
        kind = self.rng.random()
        if kind >= 0.7:
            return self.text(self.length).tolist()
        t = int(self.rng.choice(len(self.templates), p=self.pop))
        if kind >= 0.45:
            cut = int(self.rng.integers(32, 224))
            return np.concatenate([self.templates[t][:cut], self.text(self.length - cut)]).tolist()
        parts, prev = [], 0
        for s, pool in zip(self.slots[t], self.pools[t], strict=True):
            parts += [self.templates[t][prev:s], pool[int(self.rng.integers(len(pool)))]]
            prev = s + 1
        seq = np.concatenate(parts + [self.templates[t][prev:]])[: self.length]
        noise = self.rng.random(len(seq)) < 0.01
        seq[noise] = self.text(int(noise.sum()))
        return seq.tolist()


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def pct(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    at = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": statistics.fmean(xs), "n": len(xs)}


def build(cache, seqs: list[list[int]]) -> dict:
    gc.collect()
    rss0, t0 = rss_mib(), time.perf_counter()
    for s in seqs:
        cache.add_sequence(s)
    dt = time.perf_counter() - t0
    gc.collect()
    ntok = sum(map(len, seqs))
    return {"sequences": len(seqs), "tokens": ntok, "s": dt, "us_per_token": 1e6 * dt / ntok,
            "rss_mib": rss_mib() - rss0}


def replay_suffix(cache: SuffixCache, traffic: Traffic, reqs: list[list[int]], k: int,
                  churn: list[list[int]] | None) -> dict:
    """Engine-like loop; with `churn`, one new sequence enters the cache before every step."""
    prop, app = [], []
    drafted = accepted = steps = 0
    for r, truth in enumerate(reqs):
        rid = f"r{r}"
        cache.start_request(rid, traffic.text(128).tolist())
        cache.add_tokens(rid, truth[:1])
        pos = 1
        while pos < len(truth):
            if churn:
                cache.add_sequence(churn.pop())
            t0 = time.perf_counter_ns()
            spec = cache.speculate(rid, min(k, len(truth) - pos - 1))
            t1 = time.perf_counter_ns()
            a = 0
            while a < len(spec.tokens) and spec.tokens[a] == truth[pos + a]:
                a += 1
            new = truth[pos:pos + a + 1]
            t2 = time.perf_counter_ns()
            cache.add_tokens(rid, new)
            t3 = time.perf_counter_ns()
            prop.append((t1 - t0) / 1e3)
            app.append((t3 - t2) / 1e3 / len(new))
            drafted, accepted, steps = drafted + len(spec.tokens), accepted + a, steps + 1
            pos += len(new)
        cache.stop_request(rid)
    return {"propose_us": pct(prop), "append_us_per_token": pct(app),
            "mean_acceptance_length": 1 + accepted / steps, "acceptance_rate": accepted / max(1, drafted)}


def replay_ngram(table: NGramTable, reqs: list[list[int]], k: int) -> dict:
    prop = []
    drafted = accepted = steps = 0
    for truth in reqs:
        pos = 1
        while pos < len(truth):
            t0 = time.perf_counter_ns()
            spec = table.speculate(truth[:pos], min(k, len(truth) - pos - 1))
            prop.append((time.perf_counter_ns() - t0) / 1e3)
            a = 0
            while a < len(spec.tokens) and spec.tokens[a] == truth[pos + a]:
                a += 1
            drafted, accepted, steps = drafted + len(spec.tokens), accepted + a, steps + 1
            pos += a + 1
    return {"propose_us": pct(prop), "mean_acceptance_length": 1 + accepted / steps,
            "acceptance_rate": accepted / max(1, drafted)}


def evict_churn(cache, seqs: list[list[int]]) -> dict:
    """At capacity every add evicts one sequence: cost per token of add + evict."""
    t0 = time.perf_counter()
    for s in seqs:
        cache.add_sequence(s)
    dt = time.perf_counter() - t0
    return {"sequences": len(seqs), "us_per_token": 1e6 * dt / sum(map(len, seqs))}


def snapshot_time(cache) -> tuple[bytes, dict]:
    t0 = time.perf_counter()
    blob = cache.snapshot()
    return blob, {"bytes": len(blob), "snapshot_s": time.perf_counter() - t0}


def restore_time(blob: bytes, cls) -> float:
    """Restore = re-adding every sequence (call with the original freed: it needs the same RAM)."""
    gc.collect()
    t0 = time.perf_counter()
    restored = cls.restore(blob)
    dt = time.perf_counter() - t0
    del restored
    return dt


def row(name: str, d: dict) -> str:
    return f"{name:<44} {d['p50']:>9.1f} {d['p90']:>9.1f} {d['p99']:>9.1f} {d['mean']:>9.1f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sequences", type=int, default=100_000)
    ap.add_argument("--ngram-sequences", type=int, default=None, help="default: --sequences")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--max-depth", type=int, default=24)
    ap.add_argument("--skip-restore", action="store_true", help="restore rebuilds: as slow as the build")
    ap.add_argument("--skip-ngram", action="store_true")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.freeze() after the build, as CacheMaintainer does after loading/snapshots")
    ap.add_argument("--out", default="bench/results/suffix.json")
    args = ap.parse_args()

    traffic = Traffic()
    seqs = [traffic.sequence() for _ in range(args.sequences)]
    reqs = [traffic.sequence() for _ in range(args.requests)]
    extra = [traffic.sequence() for _ in range(2000)]
    res: dict = {"args": vars(args), "python": platform.python_version(), "machine": platform.processor()}

    cache = SuffixCache(SuffixConfig(max_depth=args.max_depth, max_sequences=args.sequences))
    res["suffix_build"] = build(cache, seqs)
    if args.gc_freeze:
        gc.freeze()
    res["suffix_static"] = replay_suffix(cache, traffic, reqs, args.k, None)
    res["suffix_churn"] = replay_suffix(cache, traffic, reqs[:50], args.k, list(extra))
    res["suffix_evict"] = evict_churn(cache, extra[:1000])
    blob, res["suffix_snapshot"] = snapshot_time(cache)
    del cache
    if not args.skip_restore:
        res["suffix_snapshot"]["restore_s"] = restore_time(blob, SuffixCache)
    del blob
    gc.collect()

    if not args.skip_ngram:
        nseq = args.ngram_sequences or args.sequences
        table = NGramTable(NGramConfig(max_sequences=nseq))
        res["ngram_build"] = build(table, seqs[:nseq])
        res["ngram"] = replay_ngram(table, reqs, args.k)
        res["ngram_evict"] = evict_churn(table, extra[:1000])

    print(f"{'us per call':<44} {'p50':>9} {'p90':>9} {'p99':>9} {'mean':>9}")
    print(row("suffix propose (static cache)", res["suffix_static"]["propose_us"]))
    print(row("suffix append, per token (static)", res["suffix_static"]["append_us_per_token"]))
    print(row("suffix propose (1 add_sequence per step)", res["suffix_churn"]["propose_us"]))
    if "ngram" in res:
        print(row("ngram propose", res["ngram"]["propose_us"]))
    for key in ("suffix_build", "ngram_build"):
        if key in res:
            b = res[key]
            print(f"{key}: {b['sequences']} seqs, {b['tokens']} tokens, {b['s']:.1f} s, "
                  f"{b['us_per_token']:.2f} us/token, RSS +{b['rss_mib']:.0f} MiB")
    for key in ("suffix_evict", "ngram_evict"):
        if key in res:
            print(f"{key} (add+evict at capacity): {res[key]['us_per_token']:.2f} us/token")
    for key in ("suffix_static", "suffix_churn", "ngram"):
        if key in res:
            print(f"{key}: mean acceptance length {res[key]['mean_acceptance_length']:.2f}, "
                  f"acceptance rate {res[key]['acceptance_rate']:.2f}")
    if "suffix_snapshot" in res:
        s = res["suffix_snapshot"]
        print(f"suffix snapshot: {s['bytes'] / 2**20:.1f} MiB, {s['snapshot_s']:.1f} s; "
              f"restore {s.get('restore_s', float('nan')):.1f} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
