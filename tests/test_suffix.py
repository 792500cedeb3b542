"""Suffix tree and SuffixCache against a brute-force reference (counts, speculation, eviction,
snapshots) on random token sequences with a fixed seed."""

from __future__ import annotations

import gc
import random
from collections import Counter

import pytest

from runtime.drafters.seqlog import SnapshotError
from runtime.drafters.suffix_tree import SuffixCache, SuffixConfig, SuffixTree, _Node, draft_cap


class Reference:
    """Counts every substring of length <= depth by enumeration; speculates by the paper's rule."""

    def __init__(self, seqs: list[list[int]], depth: int) -> None:
        self.depth = depth
        self.cnt: Counter = Counter()
        for s in seqs:
            for i in range(len(s)):
                for j in range(i + 1, min(i + depth, len(s)) + 1):
                    self.cnt[tuple(s[i:j])] += 1
        self.kids: dict[tuple, dict[int, int]] = {}
        for w, c in self.cnt.items():
            self.kids.setdefault(w[:-1], {})[w[-1]] = c

    def walk(self, path: tuple, budget: int, min_prob: float) -> tuple[list[int], float]:
        toks, p, score = [], 1.0, 0.0
        while len(toks) < budget:
            conts = self.kids.get(path, {})
            tot = sum(conts.values())
            if not tot:
                break
            y = min(conts, key=lambda t: (-conts[t], t))
            p = p * conts[y] / tot
            if p + 1e-9 < min_prob:
                break
            toks.append(y)
            score += p
            path += (y,)
        return toks, score

    def speculate(self, context, k, factor, offset, min_prob) -> tuple[list[int], float, int]:
        best: tuple[list[int], float, int] = ([], 0.0, 0)
        for m in range(min(self.depth, len(context)), 0, -1):  # longest first: ties keep it
            w = tuple(context[-m:])
            if not self.cnt[w]:
                continue
            cap = min(draft_cap(m, k, factor, offset), self.depth - m)
            toks, score = self.walk(w, cap, min_prob)
            if score > best[1] + 1e-9:
                best = (toks, score, m)
        return best


def random_seqs(rng: random.Random, n: int, vocab: int, lo: int = 1, hi: int = 30) -> list[list[int]]:
    # A few shared motifs so long repeated paths (and deep nodes) exist.
    motifs = [[rng.randrange(vocab) for _ in range(rng.randint(3, 12))] for _ in range(4)]
    seqs = []
    for _ in range(n):
        s: list[int] = []
        target = rng.randint(lo, hi)
        while len(s) < target:
            s += rng.choice(motifs) if rng.random() < 0.5 else [rng.randrange(vocab)]
        seqs.append(s[:target])
    return seqs


def check_counts(tree: SuffixTree, ref: Reference) -> None:
    for w, c in ref.cnt.items():
        assert tree.count(w) == c, w
        if len(w) < ref.depth:
            assert tree.continuations(w) == ref.kids.get(w, {}), w
    assert tree.continuations(()) == ref.kids.get((), {})


def check_speculation(tree: SuffixTree, ref: Reference, contexts, rng: random.Random) -> int:
    drafted = 0
    for ctx in contexts:
        k = rng.choice([1, 3, 8, 16])
        factor, offset = rng.choice([(1.0, 0.0), (2.0, 1.0), (0.5, 0.0), (4.0, 2.0)])
        min_prob = rng.choice([0.0, 0.1, 0.3, 0.6])
        got = tree.speculate(tree.match(ctx[-tree.max_depth:]), k, factor, offset, min_prob)
        toks, score, m = ref.speculate(ctx, k, factor, offset, min_prob)
        assert (got.tokens, got.match_len) == (toks, m), (ctx, k, factor, offset, min_prob)
        assert got.score == pytest.approx(score)
        drafted += len(toks)
    return drafted


@pytest.mark.parametrize("depth,vocab", [(1, 3), (4, 3), (6, 5), (24, 4)])
def test_counts_and_speculation_match_bruteforce(depth, vocab):
    rng = random.Random(depth * 100 + vocab)
    tree = SuffixTree(depth)
    live: dict[int, list[int]] = {}
    for _ in range(6):
        for s in random_seqs(rng, 25, vocab):
            live[tree.add(tuple(s))] = s
        for uid in rng.sample(sorted(live), len(live) // 3):  # evict a third, any order
            tree.remove(uid)
            del live[uid]
        ref = Reference(list(live.values()), depth)
        check_counts(tree, ref)
        contexts = [rng.choice(list(live.values()))[: rng.randint(1, 30)] for _ in range(40)]
        contexts += random_seqs(rng, 40, vocab)  # mostly unseen suffixes
        # extend a seen prefix with a fresh tail: matches that end inside leaves
        contexts += [c + [rng.randrange(vocab)] for c in contexts[:20]]
        drafted = check_speculation(tree, ref, contexts, rng)
        assert drafted > 0 or depth == 1
    for uid in list(live):
        tree.remove(uid)
    assert tree.continuations(()) == {} and tree.root.total == 0 and not tree.root.kids


def test_open_sequence_counts_itself_but_not_its_open_end():
    rng = random.Random(7)
    for depth in (3, 8, 24):
        tree = SuffixTree(depth)
        uid = tree.open()
        seq: list[int] = []
        for _ in range(60):
            new = [rng.randrange(4) for _ in range(rng.randint(1, 4))]
            tree.extend(uid, new)
            seq += new
            ref = Reference([seq], depth)
            check_counts(tree, ref)
            got = tree.speculate(tree.open_state(uid), 8, 1.0, 1.0, 0.1)
            toks, score, m = ref.speculate(seq, 8, 1.0, 1.0, 0.1)
            assert (got.tokens, got.match_len) == (toks, m)
            assert got.score == pytest.approx(score)


def test_incremental_match_equals_fresh_match():
    rng = random.Random(3)
    tree = SuffixTree(8)
    for s in random_seqs(rng, 50, 4):
        tree.add(tuple(s))
    ctx = random_seqs(rng, 1, 4, 80, 80)[0]
    state = tree.match([])
    for i, t in enumerate(ctx):
        state = tree.match([t], state)
        fresh = tree.match(ctx[max(0, i + 1 - 8):i + 1])
        a = tree.speculate(state, 8, 1.0, 0.0, 0.1)
        b = tree.speculate(fresh, 8, 1.0, 0.0, 0.1)
        assert (a.tokens, a.score, a.match_len) == (b.tokens, b.score, b.match_len)


def test_handwritten_speculation():
    tree = SuffixTree(24)
    tree.add((1, 2, 3, 4, 5))
    tree.add((1, 2, 3, 4, 6))
    tree.add((1, 2, 3, 4, 6))
    # After [1, 2, 3] the path 4 has probability 1, then 6 has 2/3: score 1 + 2/3.
    spec = tree.speculate(tree.match([9, 1, 2, 3]), 8, 1.0, 0.0, 0.1)
    assert spec.tokens == [4, 6] and spec.score == pytest.approx(1 + 2 / 3) and spec.match_len == 3
    # factor 1, offset 0: a 1-token match drafts at most 1 token.  Not [4, 6].
    assert tree.speculate(tree.match([3]), 8, 1.0, 0.0, 0.1).tokens == [4]
    # min_token_prob above 2/3 stops before the uncertain token.
    assert tree.speculate(tree.match([1, 2, 3]), 8, 1.0, 0.0, 0.7).tokens == [4]
    assert tree.speculate(tree.match([7, 7]), 8, 1.0, 0.0, 0.1).tokens == []


def test_cache_bounds_evict_oldest_whole_sequences():
    cache = SuffixCache(SuffixConfig(max_depth=6, max_sequences=3))
    for i in range(5):
        cache.add_sequence([10 + i, 20 + i, 30 + i, 40 + i])
    assert cache.num_sequences == 3 and cache.num_tokens == 12
    cache.start_request("r", [10, 20, 30])  # only sequence 0 had this: evicted
    assert cache.speculate("r", 4).tokens == []
    cache.stop_request("r")
    cache.start_request("r", [14, 24])
    assert cache.speculate("r", 4).tokens == [34, 44]
    cache.stop_request("r")

    cache = SuffixCache(SuffixConfig(max_depth=6, max_sequences=100, max_tokens=10))
    for i in range(6):
        cache.add_sequence(list(range(i * 10, i * 10 + 4)))
        assert cache.num_tokens <= 10
    assert cache.num_sequences == 2
    cache.add_sequence(list(range(100, 130)))  # longer than the bound: clipped, not lost whole
    assert cache.num_tokens == 10 and cache.num_sequences == 1


def test_cache_eviction_matches_a_cache_that_never_saw_the_evicted():
    rng = random.Random(11)
    seqs = random_seqs(rng, 300, 6, 5, 40)
    bounded = SuffixCache(SuffixConfig(max_depth=10, max_sequences=50))
    for s in seqs:
        bounded.add_sequence(s)
    fresh = SuffixCache(SuffixConfig(max_depth=10, max_sequences=50))
    for s in seqs[-50:]:
        fresh.add_sequence(s)
    assert_same_speculation(bounded, fresh, random_seqs(rng, 60, 6, 5, 30))


def assert_same_speculation(a: SuffixCache, b: SuffixCache, prompts, tag=None) -> int:
    drafted = 0
    for i, p in enumerate(prompts):
        for c in (a, b):
            c.start_request(f"q{i}", p, tag=tag)
        x, y = a.speculate(f"q{i}", 8), b.speculate(f"q{i}", 8)
        assert (x.tokens, x.score, x.origin) == (y.tokens, y.score, y.origin)
        drafted += len(x.tokens)
        for c in (a, b):
            c.stop_request(f"q{i}")
    return drafted


def test_request_tree_and_global_tree_best_wins():
    cache = SuffixCache(SuffixConfig(max_depth=16))
    cache.add_sequence([5, 6, 7, 8, 9, 10, 11])
    cache.start_request("r", [1, 2, 3, 4, 1, 2])
    spec = cache.speculate("r", 4)  # own prompt: [1, 2] was followed by [3, 4]
    assert spec.tokens == [3, 4] and spec.origin == "request"
    cache.add_tokens("r", [5, 6, 7])
    spec = cache.speculate("r", 4)  # global: [5, 6, 7] then [8, 9, 10] (cap 3 for a 3-match)
    assert spec.tokens == [8, 9, 10] and spec.origin == "global"
    assert cache.request_tokens("r") == [1, 2, 3, 4, 1, 2, 5, 6, 7]
    cache.stop_request("r")


def test_tag_scoping_isolates_tenants():
    for scoped in (True, False):
        cache = SuffixCache(SuffixConfig(max_depth=8, tag_scoped=scoped))
        cache.add_sequence([1, 2, 3, 4, 5, 6], tag="a")
        for tag, expected in (("a", [4, 5, 6]), ("b", []), (None, [])):
            cache.start_request("r", [1, 2, 3], tag=tag)
            assert cache.speculate("r", 4).tokens == (expected if scoped else [4, 5, 6])
            cache.stop_request("r")


def test_lifecycle_misuse_raises_value_error():
    cache = SuffixCache()
    with pytest.raises(ValueError, match="not started"):
        cache.speculate("x", 3)
    with pytest.raises(ValueError, match="not started"):
        cache.add_tokens("x", [1])
    with pytest.raises(ValueError, match="not started"):
        cache.stop_request("x")
    cache.start_request("x", [1])
    with pytest.raises(ValueError, match="already started"):
        cache.start_request("x", [1])
    with pytest.raises(ValueError, match="token ids"):
        cache.add_sequence([1, -2])
    with pytest.raises(ValueError, match="max_depth"):
        SuffixConfig(max_depth=0)


def test_snapshot_round_trip_restores_identical_cache():
    rng = random.Random(5)
    cfg = SuffixConfig(max_depth=12, max_sequences=80, tag_scoped=True)
    cache = SuffixCache(cfg)
    for i, s in enumerate(random_seqs(rng, 200, 70000, 5, 60)):  # ids > 65535: 32-bit packing
        cache.add_sequence([t % 7 if i % 2 else t for t in s], tag=rng.choice([None, "t1", "t2"]))
    cache.stream_offsets = {0: 200, 3: 17}
    blob = cache.snapshot()
    back = SuffixCache.restore(blob)
    assert back.config == cfg and back.stream_offsets == {0: 200, 3: 17}
    assert back.num_sequences == cache.num_sequences == 80 and back.num_tokens == cache.num_tokens
    assert back.snapshot() == blob
    prompts = random_seqs(rng, 40, 7, 3, 20)
    drafted = sum(assert_same_speculation(cache, back, prompts, tag=t) for t in (None, "t1", "t2"))
    assert drafted > 0


def test_snapshot_rejects_corrupt_foreign_and_newer_bytes():
    cache = SuffixCache()
    cache.add_sequence([1, 2, 3])
    blob = bytearray(cache.snapshot())
    with pytest.raises(SnapshotError, match="checksum"):
        SuffixCache.restore(bytes(blob[:-3]))
    flipped = bytearray(blob)
    flipped[-5] ^= 0xFF
    with pytest.raises(SnapshotError, match="corrupt"):
        SuffixCache.restore(bytes(flipped))
    newer = bytearray(blob)
    newer[5] = 99
    with pytest.raises(SnapshotError, match="format 99 is not supported"):
        SuffixCache.restore(bytes(newer))
    with pytest.raises(SnapshotError, match="bad magic"):
        SuffixCache.restore(b"hello world, not a snapshot")
    from runtime.drafters.ngram import NGramTable

    with pytest.raises(SnapshotError, match="expected 'ngram'"):
        NGramTable.restore(bytes(blob))


def test_evicted_nodes_are_freed_without_the_cycle_collector():
    rng = random.Random(8)
    gc.collect()
    gc.disable()
    try:
        before = sum(type(o) is _Node for o in gc.get_objects())
        tree = SuffixTree(12)
        uids = [tree.add(tuple(s)) for s in random_seqs(rng, 80, 4, 10, 40)]
        assert sum(type(o) is _Node for o in gc.get_objects()) > before + 100
        for uid in uids:
            tree.remove(uid)
        assert sum(type(o) is _Node for o in gc.get_objects()) == before + 1  # the root
    finally:
        gc.enable()


def test_chunked_insert_and_eviction_states_are_valid_caches():
    """Between chunks a reader sees the tree of a prefix (insert) or suffix (eviction)."""
    rng = random.Random(12)
    seqs = random_seqs(rng, 30, 4, 10, 40)
    tree = SuffixTree(8)
    uids = [tree.add(tuple(s)) for s in seqs[1:]]
    uid, s0 = tree.open(), seqs[0]
    for i in range(0, len(s0), 7):
        tree.extend(uid, s0[i:i + 7])
        check_counts(tree, Reference(seqs[1:] + [s0[:i + 7]], 8))
    tree.close(uid, tuple(s0))
    with pytest.raises(ValueError, match="differ"):
        tree.close(uids[0], (1, 2))
    for first in range(0, len(s0), 5):
        tree.remove(uid, first, first + 5)
        check_counts(tree, Reference(seqs[1:] + [s0[first + 5:]], 8))
    assert len(tree) == len(seqs) - 1
