"""NGramTable against a brute-force reference: counts, backoff chaining, eviction, tags, snapshots."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from runtime.drafters.ngram import NGramConfig, NGramTable
from runtime.drafters.seqlog import SnapshotError


def ref_counts(seqs, lo, hi) -> dict[tuple, Counter]:
    table: dict[tuple, Counter] = {}
    for s in seqs:
        for i in range(1, len(s)):
            for n in range(lo, min(hi, i) + 1):
                table.setdefault(tuple(s[i - n:i]), Counter())[s[i]] += 1
    return table


def ref_speculate(table, context, k, lo, hi, min_prob) -> tuple[list[int], float]:
    ctx, toks, p, score = list(context), [], 1.0, 0.0
    while len(toks) < k:
        conts = None
        for n in range(min(hi, len(ctx)), lo - 1, -1):  # longest known context first
            conts = table.get(tuple(ctx[len(ctx) - n:]))
            if conts:
                break
        if not conts:
            break
        y = min(conts, key=lambda t: (-conts[t], t))
        p = p * conts[y] / sum(conts.values())
        if p + 1e-9 < min_prob:
            break
        toks.append(y)
        ctx.append(y)
        score += p
    return toks, score


@pytest.mark.parametrize("lo,hi,vocab", [(1, 1, 3), (1, 3, 4), (2, 4, 5)])
def test_table_matches_bruteforce_with_eviction(lo, hi, vocab):
    rng = random.Random(lo * 10 + hi)
    cfg = NGramConfig(max_n=hi, min_n=lo, max_sequences=40)
    table = NGramTable(cfg)
    seqs = []
    drafted = 0
    for _ in range(4):
        for _ in range(30):
            s = [rng.randrange(vocab) for _ in range(rng.randint(1, 25))]
            seqs.append(s)
            table.add_sequence(s)
        live = seqs[-40:]
        ref = ref_counts(live, lo, hi)
        for ctx, counts in ref.items():
            assert table.continuations(ctx) == dict(counts)
        assert table.num_contexts() == len(ref)
        for _ in range(60):
            ctx = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
            k, min_prob = rng.choice([1, 4, 8]), rng.choice([0.0, 0.1, 0.4])
            spec = table.speculate(ctx, k, min_token_prob=min_prob)
            toks, score = ref_speculate(ref, ctx, k, lo, hi, min_prob)
            assert spec.tokens == toks and spec.score == pytest.approx(score)
            drafted += len(toks)
    assert drafted > 0


def test_handwritten_chain_and_backoff():
    table = NGramTable(NGramConfig(max_n=2, min_n=1))
    table.add_sequence([1, 2, 3, 1, 2, 4])
    # [1, 2] -> {3: 1, 4: 1}: tie to the smaller token at probability 1/2, then [2, 3] -> 1.
    spec = table.speculate([1, 2], 3)
    assert spec.tokens == [3, 1, 2] and spec.score == pytest.approx(0.5 * 3)
    # [9, 3] is unseen, back off to [3] -> 1.
    assert table.speculate([9, 3], 1).tokens == [1]
    assert table.speculate([9], 3).tokens == []


def test_tags_are_isolated_and_eviction_drops_whole_sequences():
    table = NGramTable(NGramConfig(max_sequences=2, tag_scoped=True))
    table.add_sequence([1, 2, 3], tag="a")
    assert table.speculate([1, 2], 2, tag="a").tokens == [3]
    assert table.speculate([1, 2], 2, tag="b").tokens == []
    assert table.speculate([1, 2], 2).tokens == []
    table.add_sequence([5, 6], tag="b")
    table.add_sequence([7, 8], tag="b")  # evicts tag a's only sequence
    assert table.speculate([1, 2], 2, tag="a").tokens == []
    assert table.num_sequences == 2 and table.num_contexts("a") == 0
    shared = NGramTable(NGramConfig(tag_scoped=False))
    shared.add_sequence([1, 2, 3], tag="a")
    assert shared.speculate([1, 2], 2, tag="b").tokens == [3]


def test_snapshot_round_trip():
    rng = random.Random(2)
    table = NGramTable(NGramConfig(max_sequences=30, tag_scoped=True))
    for _ in range(50):
        table.add_sequence([rng.randrange(6) for _ in range(20)], tag=rng.choice([None, "x"]))
    table.stream_offsets = {0: 50}
    back = NGramTable.restore(table.snapshot())
    assert back.config == table.config and back.stream_offsets == {0: 50}
    for tag in (None, "x"):
        assert back.num_contexts(tag) == table.num_contexts(tag)
        for _ in range(30):
            ctx = [rng.randrange(6) for _ in range(3)]
            a, b = table.speculate(ctx, 5, tag=tag), back.speculate(ctx, 5, tag=tag)
            assert (a.tokens, a.score) == (b.tokens, b.score)
    with pytest.raises(SnapshotError):
        NGramTable.restore(table.snapshot()[:-1])


def test_bad_config_and_ids():
    with pytest.raises(ValueError, match="min_n"):
        NGramConfig(max_n=1, min_n=2)
    with pytest.raises(ValueError, match="token ids"):
        NGramTable().add_sequence([1, 1 << 22])
