"""N-gram continuation tables over logged traffic (lookahead / Token Recycling style).

For every context of n tokens (min_n <= n <= max_n) seen in the cached sequences, the table
counts the tokens that followed it. A draft chains greedily: take the longest context of the
current suffix that the table knows (backing off to shorter ones), append its most frequent
continuation, repeat; stop at k tokens or once the path probability (product of
count(next) / count(context) along the chain) falls below min_token_prob. The score, the sum of
path probabilities, is on the same scale as the suffix cache's (expected accepted tokens).

Memory: keys pack the context into one int (a leading 1 bit, then 21 bits per token, last
token lowest); a context seen once stores its continuation as a bare shared int, and only
contexts with two or more observations get a [best, best_count, total, counts] list.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from runtime.drafters.seqlog import (
    LoggedSequence,
    SnapshotMixin,
)
from runtime.drafters.suffix_tree import Speculation

_BITS = 21  # bits per token in a key; seqlog.MAX_TOKEN_ID fits
_TIE = 1e-9  # probabilities closer than this are equal (float products differ in the last bit)
_DIRTY = -2  # entry[0] when the best continuation must be recomputed (after an eviction)

# A table value is a bare token (seen once after this context) or [best, best_count, total,
# counts-or-None]; counts is None while `best` is the only continuation seen.


def context_key(context: Sequence[int]) -> int:
    """The table key of `context` (all of it)."""
    key = 0
    for j, t in enumerate(reversed(context)):
        key |= t << (_BITS * j)
    return key | (1 << (_BITS * len(context)))


@dataclass(frozen=True)
class NGramConfig:
    """max_n 3 with backoff to 1: trigrams are where traffic repeats reliably; longer contexts
    multiply memory (one entry per position and order) for little extra acceptance, which
    the suffix cache already covers. min_token_prob 0.1 as for the suffix cache."""

    max_n: int = 3
    min_n: int = 1
    min_token_prob: float = 0.1
    max_sequences: int = 10_000
    max_tokens: int | None = None
    tag_scoped: bool = True  # one table per tag: a request drafts only from its tag's outputs
    include_prompt: bool = False  # cache prompt + output of a request (default: its output, as SuffixDecoding)

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")


class NGramTable(SnapshotMixin):
    """Continuation counts of the last `max_sequences` finished outputs (one table per tag
    when config.tag_scoped: a speculation for tag T then reads only sequences added with tag
    T, None being a tag of its own).
    Thread-safe: one lock serialises updates and lookups.
    """

    CONFIG = NGramConfig
    SNAPSHOT_KIND = "ngram"

    def __init__(self, config: NGramConfig | None = None) -> None:
        self._init_sequences(config or NGramConfig())
        self._tables: dict[str | None, dict[int, int | list]] = {}

    def num_contexts(self, tag: str | None = None) -> int:
        return len(self._tables.get(self._key(tag), ()))

    def _insert(self, toks: tuple[int, ...], tag: str | None) -> int:
        with self._lock:
            self._update(self._tables.setdefault(self._key(tag), {}), toks, _inc)
        return -1

    def _remove(self, old: LoggedSequence) -> None:
        key = self._key(old.tag)
        with self._lock:
            table = self._tables[key]
            self._update(table, old.tokens, _dec)
            if not table:
                del self._tables[key]

    def _update(self, table: dict, seq: Sequence[int], op) -> None:  # noqa: ANN001
        lo, hi = self.config.min_n, self.config.max_n
        for i in range(1, len(seq)):
            y, key = seq[i], 0
            for n in range(1, min(hi, i) + 1):
                key |= seq[i - n] << (_BITS * (n - 1))
                if n >= lo:
                    op(table, key | (1 << (_BITS * n)), y)

    def speculate(
        self,
        context: Sequence[int],
        max_tokens: int,
        *,
        tag: str | None = None,
        min_token_prob: float | None = None,
    ) -> Speculation:
        """Greedy chain of most frequent continuations; match_len is the context length used
        for the first token."""
        cfg = self.config
        min_prob = cfg.min_token_prob if min_token_prob is None else min_token_prob
        with self._lock:
            table = self._tables.get(self._key(tag))
            if table is None or max_tokens <= 0:
                return Speculation()
            ctx = list(context[-cfg.max_n:])
            toks: list[int] = []
            score, p, first = 0.0, 1.0, 0
            while len(toks) < max_tokens:
                v, used = self._longest(table, ctx)
                if v is None:
                    break
                y, prob = _best(v)
                p *= prob
                if p + _TIE < min_prob:  # ratios multiplied in another order must not flip this
                    break
                toks.append(y)
                ctx.append(y)
                score += p
                first = first or used
            return Speculation(toks, score, first, "ngram" if toks else "")

    def _longest(self, table: dict, ctx: list[int]) -> tuple[int | list | None, int]:
        """The entry of the longest suffix of ctx in the table, and its length."""
        lo, hi = self.config.min_n, self.config.max_n
        found, used, key, n_ctx = None, 0, 0, len(ctx)
        for n in range(1, min(hi, n_ctx) + 1):
            key |= ctx[n_ctx - n] << (_BITS * (n - 1))
            if n < lo:
                continue
            v = table.get(key | (1 << (_BITS * n)))
            if v is None:  # never seen: no longer suffix was either
                break
            found, used = v, n
        return found, used

    def continuations(self, context: Sequence[int], tag: str | None = None) -> dict[int, int]:
        """{next token: count} after exactly `context` (tests, debugging)."""
        with self._lock:
            v = self._tables.get(self._key(tag), {}).get(context_key(context))
        if v is None:
            return {}
        if type(v) is int:
            return {v: 1}
        return dict(v[3]) if v[3] is not None else {v[0]: v[1]}


def _best(v: int | list) -> tuple[int, float]:
    """(most frequent continuation, its share); ties go to the smaller token."""
    if type(v) is int:
        return v, 1.0
    if v[0] == _DIRTY:
        t, c = min(v[3].items(), key=lambda kv: (-kv[1], kv[0]))
        v[0], v[1] = t, c
    return v[0], v[1] / v[2]


def _inc(table: dict, key: int, y: int) -> None:
    v = table.get(key)
    if v is None:
        table[key] = y
        return
    if type(v) is int:
        table[key] = [y, 2, 2, None] if v == y else [min(v, y), 1, 2, {v: 1, y: 1}]
        return
    v[2] += 1
    counts = v[3]
    if counts is None:
        if v[0] == y:
            v[1] += 1
            return
        counts = v[3] = {v[0]: v[1]}
    c = counts[y] = counts.get(y, 0) + 1
    if v[0] == y:
        v[1] = c
    elif v[0] != _DIRTY and (c > v[1] or (c == v[1] and y < v[0])):
        v[0], v[1] = y, c


def _dec(table: dict, key: int, y: int) -> None:
    v = table[key]
    if type(v) is int or v[2] == 1:
        del table[key]
        return
    v[2] -= 1
    counts = v[3]
    if counts is None:
        v[1] -= 1
    else:
        c = counts[y] - 1
        if c:
            counts[y] = c
        else:
            del counts[y]
        if v[0] == y:
            v[0] = _DIRTY  # a sibling may now lead; recomputed when drafted from
    if v[2] == 1:  # back to the one-int form
        table[key] = next(iter(counts)) if counts is not None else v[0]
