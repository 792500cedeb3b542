"""Depth-bounded suffix trie with occurrence counts, and the SuffixDecoding cache built on it.

Every substring of length <= max_depth of the stored sequences is a path from the root. For a
path w, `count(w)` is its number of occurrences and `total(w)` the number of those followed by
another token inside the depth bound, so P(x | w) = count(wx) / total(w). An occurrence at the
end of a sequence (or of a request still being generated) adds to `count` but not to `total`,
so a request's own open suffix never deflates the probabilities drafted from it.

Memory. A substring seen once is not materialised: its parent keeps a *leaf*, the packed
position (sequence id << 32 | offset) of that occurrence, and the rest of the path is read from
the stored sequence. Nodes exist only for substrings seen at least twice (eviction can leave
some at one). A node keeps its best child inline (`tok`, `kid`) and builds a dict only for a
second child: a one-entry dict costs 224 B in CPython 3.11, a whole node 80 B.

Speculation (SuffixDecoding, arXiv 2411.04975): for every length m of a suffix of the context
found in the tree, walk the most frequent continuation while the path probability (product of
count ratios) stays >= min_token_prob, for at most min(k, int(factor * m + offset), max_depth - m)
tokens (the depth bounds match plus draft). Score = sum of path probabilities, the expected
number of accepted tokens. The best score wins; ties go to the longer match.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from runtime.drafters.seqlog import (
    LoggedSequence,
    SnapshotMixin,
    intern_tokens,
)

_NONE = -1  # node.tok when the node has no child
_DIRTY = -2  # node.tok when the best child must be recomputed (an eviction lowered it);
# node.kid then holds an upper bound of the best child's count, so a walk can stop at a
# high-fanout node whose best child is below min_token_prob without scanning its children
_SHIFT = 32
_MASK = (1 << _SHIFT) - 1
_CHUNK = 32  # tokens inserted or evicted per lock hold: bounds how long a reader waits on a writer
_TIE = 1e-9  # scores closer than this tie (float sums of equal ratios differ in the last bit)

# Matching state against one tree: deepest node matched, its depth, and the count-1 tail (the
# position after the single occurrence of the longest unmaterialised match, -1 if none) and
# that match's length.
State = tuple["_Node", int, int, int]


class _Node:
    __slots__ = ("count", "total", "link", "tok", "kid", "kids")

    def __init__(self, count: int, link: _Node | None) -> None:
        self.count = count  # occurrences of this path
        self.total = 0  # occurrences followed by a token: sum of the children's counts
        self.link = link  # node of this path without its first token (suffix link)
        self.tok = _NONE  # best child's token: highest count, then smallest token
        self.kid: _Node | int | None = None  # best child: a node or a leaf position
        self.kids: dict[int, _Node | int] | None = None  # every child, once there are two


def draft_cap(match_len: int, max_tokens: int, factor: float, offset: float) -> int:
    """min(max_tokens, int(factor * match_len + offset)), never negative."""
    return max(0, min(max_tokens, int(match_len * factor + offset + 1e-6)))


@dataclass
class Speculation:
    """A draft, its score (expected accepted tokens) and the suffix match it came from."""

    tokens: list[int] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0
    origin: str = ""  # "request" (own prompt/output), "global", "ngram"; "" when empty


class SuffixTree:
    """Counts of all substrings (length <= max_depth) of a set of token sequences.

    Finished sequences go in whole (`add`) and leave whole (`remove`); a sequence being
    generated is `open`ed and `extend`ed. Not thread-safe: SuffixCache serialises access.
    `epoch` changes on every mutation, so a cached match State can tell it is stale.
    """

    def __init__(self, max_depth: int = 24) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node(0, None)
        self.epoch = 0
        self._seqs: dict[int, Sequence[int]] = {}
        self._chains: dict[int, list[_Node]] = {}  # open sequence -> nodes of its suffixes
        self._next_uid = 0

    def __len__(self) -> int:
        return len(self._seqs)

    # -- mutation -------------------------------------------------------------------------

    def add(self, tokens: Sequence[int]) -> int:
        """Inserts a finished sequence (kept by reference: pass a tuple); returns its id."""
        uid = self._new_uid(tokens)
        chain, base = [self.root], uid << _SHIFT
        for i in range(len(tokens)):
            chain = self._push(chain, tokens, base, i)
        self.epoch += 1
        return uid

    def open(self) -> int:
        """Starts an empty sequence that grows with `extend`."""
        uid = self._new_uid([])
        self._chains[uid] = [self.root]
        return uid

    def extend(self, uid: int, tokens: Sequence[int]) -> None:
        seq, chain, base = self._seqs[uid], self._chains[uid], uid << _SHIFT
        for t in tokens:
            seq.append(t)
            chain = self._push(chain, seq, base, len(seq) - 1)
        self._chains[uid] = chain
        self.epoch += 1

    def close(self, uid: int, tokens: tuple[int, ...]) -> None:
        """Ends an open sequence; `tokens` (equal to what was extended) replaces its list."""
        if tuple(self._seqs[uid]) != tokens:
            raise ValueError("close: tokens differ from the sequence that was extended")
        self._seqs[uid] = tokens
        self._chains.pop(uid, None)

    def remove(self, uid: int, first: int = 0, stop: int | None = None) -> None:
        """Removes the occurrences starting at positions [first, stop) of a sequence (all by
        default): decrements their counts and prunes paths that reach zero. Removing a
        sequence in chunks front to back keeps the tree valid in between (it then holds the
        sequence's remaining suffix); the sequence is forgotten once its last chunk is gone."""
        seq = self._seqs[uid]
        depth, root, n_tok = self.max_depth, self.root, len(seq)
        stop = n_tok if stop is None else min(stop, n_tok)
        if stop == n_tok:
            del self._seqs[uid]
            self._chains.pop(uid, None)
        for s in range(first, stop):
            n = root
            for j in range(s, min(s + depth, n_tok)):
                y = seq[j]
                c = n.kid if n.tok == y else n.kids[y]
                n.total -= 1
                if type(c) is int or c.count == 1:  # its last occurrence: drop the whole subtree
                    self._drop(n, y)
                    break
                c.count -= 1
                if n.tok == y and n.kids is not None:  # a sibling may now win: recompute when walked
                    n.tok, n.kid = _DIRTY, c.count + 1  # siblings had <= the old count
                n = c
        self.epoch += 1

    def _new_uid(self, seq: Sequence[int]) -> int:
        uid, self._next_uid = self._next_uid, self._next_uid + 1
        self._seqs[uid] = seq
        return uid

    def _push(self, chain: list[_Node], seq: Sequence[int], base: int, i: int) -> list[_Node]:
        """Counts seq[i] after every materialised suffix of seq[:i] (`chain`, root first, the
        node at index j spells seq[i-j:i]); returns the chain for seq[:i+1]."""
        y, p, depth = seq[i], base | i, self.max_depth
        new = [self.root]
        for j, n in enumerate(chain):
            if j == depth:
                break
            n.total += 1
            tok = n.tok
            if tok == y:
                c = n.kid
            else:
                c = n.kids.get(y) if n.kids is not None else None
            if c is None:  # first occurrence of this path: a leaf
                self._add_leaf(n, y, p)
            elif type(c) is _Node:
                c.count += 1
                if tok != y:
                    self._promote(n, y, c)
                new.append(c)
            else:  # second occurrence: materialise; its link is the child just handled above
                new.append(self._split(n, y, c, new[-1], j + 1))
        return new

    def _add_leaf(self, n: _Node, y: int, p: int) -> None:
        tok = n.tok
        if tok == _NONE:
            n.tok, n.kid = y, p
            return
        if n.kids is None:
            n.kids = {tok: n.kid}
        n.kids[y] = p
        if tok != _DIRTY:
            b = n.kid
            if (b.count if type(b) is _Node else 1) == 1 and y < tok:
                n.tok, n.kid = y, p

    def _promote(self, n: _Node, y: int, c: _Node) -> None:
        """Makes c (child y, count just raised) the best child if it now beats the best."""
        tok = n.tok
        if tok == _DIRTY:
            if c.count > n.kid:
                n.kid = c.count  # keep the bound an upper bound
            return
        b = n.kid
        bn = b.count if type(b) is _Node else 1
        if c.count > bn or (c.count == bn and y < tok):
            n.tok, n.kid = y, c

    def _split(self, n: _Node, y: int, q: int, link: _Node, depth: int) -> _Node:
        """Turns leaf q (child y of n, at `depth`) into a node with count 2."""
        c = _Node(2, link)
        if depth < self.max_depth:  # the old occurrence's next token stays a leaf below c
            s, o = self._seqs[q >> _SHIFT], (q & _MASK) + 1
            if o < len(s):
                c.tok, c.kid, c.total = s[o], q + 1, 1
        if n.kids is not None:
            n.kids[y] = c
        if n.tok == y:
            n.kid = c
        else:
            self._promote(n, y, c)
        return c

    def _drop(self, n: _Node, y: int) -> None:
        kids = n.kids
        if kids is None:
            n.tok, n.kid = _NONE, None
            return
        del kids[y]
        if len(kids) == 1:
            ((t, c),) = kids.items()
            n.tok, n.kid, n.kids = t, c, None
        elif n.tok == y:
            n.tok, n.kid = _DIRTY, 1  # the dropped best had count 1: no sibling has more

    @staticmethod
    def _rebest(n: _Node) -> None:
        bt, bc, bn = _NONE, None, 0
        for t, c in n.kids.items():
            cn = c.count if type(c) is _Node else 1
            if cn > bn or (cn == bn and t < bt):
                bt, bc, bn = t, c, cn
        n.tok, n.kid = bt, bc

    # -- matching and drafting ------------------------------------------------------------

    def match(self, context: Sequence[int], state: State | None = None) -> State:
        """Feeds `context` through the trie (Aho-Corasick over suffix links), from `state` or
        the root. Only the last max_depth tokens can matter; pass no more than those."""
        n, d, tq, tl = state if state is not None else (self.root, 0, -1, 0)
        depth, seqs = self.max_depth, self._seqs
        for y in context:
            if tq >= 0:  # does the single occurrence of the longest match go on with y?
                s, o = seqs[tq >> _SHIFT], tq & _MASK
                if o < len(s) and s[o] == y:
                    tq, tl = tq + 1, min(tl + 1, depth)
                else:
                    tq, tl = -1, 0
            while True:
                if d < depth:
                    c = n.kid if n.tok == y else (n.kids.get(y) if n.kids is not None else None)
                    if type(c) is _Node:
                        n, d = c, d + 1
                        break
                    if c is not None and tq < 0:  # a leaf: the longest match is seen once
                        tq, tl = c + 1, d + 1
                if d == 0:
                    break
                n, d = n.link, d - 1
            if tl <= d:
                tq, tl = -1, 0
        return n, d, tq, tl

    def open_state(self, uid: int) -> State:
        """The match state of an open sequence against its own tree (free: kept by extend)."""
        chain = self._chains[uid]
        return chain[-1], len(chain) - 1, -1, 0

    def speculate(
        self, state: State, max_tokens: int, factor: float, offset: float, min_prob: float
    ) -> Speculation:
        """Best draft over every match length in `state` (see the module docstring)."""
        n, d, tq, tl = state
        best = Speculation()
        if tq >= 0:  # matches longer than d were seen once: copy that occurrence, probability 1
            best = self._tail_draft(tq, tl, d, max_tokens, factor, offset)
        while d > 0:
            cap = draft_cap(d, max_tokens, factor, offset)
            if cap <= best.score + _TIE:  # caps shrink with m: no shorter match can win
                break
            budget = min(cap, self.max_depth - d)
            if budget > best.score + _TIE:
                toks, score = self._walk(n, d, budget, min_prob)
                if score > best.score + _TIE:
                    best = Speculation(toks, score, d)
            n, d = n.link, d - 1
        return best

    def _tail_draft(
        self, tq: int, tl: int, d: int, max_tokens: int, factor: float, offset: float
    ) -> Speculation:
        s, o = self._seqs[tq >> _SHIFT], tq & _MASK
        avail, best_r, best_m = len(s) - o, 0, 0
        for m in range(tl, d, -1):
            r = min(draft_cap(m, max_tokens, factor, offset), self.max_depth - m, avail)
            if r > best_r:
                best_r, best_m = r, m
        return Speculation(list(s[o:o + best_r]), float(best_r), best_m) if best_r else Speculation()

    def _walk(self, n: _Node, d: int, budget: int, min_prob: float) -> tuple[list[int], float]:
        """Greedy most-frequent path below n (at depth d): (tokens, sum of path probabilities)."""
        toks: list[int] = []
        score, p = 0.0, 1.0
        while len(toks) < budget:
            tot = n.total
            if tot == 0:
                break
            if n.tok == _DIRTY:
                if p * n.kid / tot + _TIE < min_prob:  # even the best child is too unlikely
                    break
                self._rebest(n)
            c = n.kid
            if type(c) is _Node:
                p = p * c.count / tot
                if p + _TIE < min_prob:  # ratios multiplied in another order must not flip this
                    break
                toks.append(n.tok)
                score += p
                n, d = c, d + 1
                continue
            p /= tot  # a leaf: seen once, so the rest of its path follows with probability 1
            if p + _TIE < min_prob:  # ratios multiplied in another order must not flip this
                break
            toks.append(n.tok)
            s, o = self._seqs[c >> _SHIFT], (c & _MASK) + 1
            rest = s[o:o + min(budget - len(toks), self.max_depth - d - 1)]
            toks.extend(rest)
            score += p * (1 + len(rest))
            break
        return toks, score

    # -- inspection (tests, debugging) ----------------------------------------------------

    def continuations(self, path: Sequence[int]) -> dict[int, int]:
        """{next token: count} after `path` (empty if absent or at the depth bound)."""
        if len(path) >= self.max_depth:
            return {}
        n, pos = self._locate(path)
        if n is None:
            if pos < 0:
                return {}
            s, o = self._seqs[pos >> _SHIFT], pos & _MASK
            return {s[o]: 1} if o < len(s) else {}
        if n.kids is not None:
            return {t: (c.count if type(c) is _Node else 1) for t, c in n.kids.items()}
        return {n.tok: (n.kid.count if type(n.kid) is _Node else 1)} if n.tok != _NONE else {}

    def count(self, path: Sequence[int]) -> int:
        """Occurrences of `path` (0 < len <= max_depth) in the stored sequences."""
        if not 0 < len(path) <= self.max_depth:
            raise ValueError(f"path length must be in [1, {self.max_depth}], got {len(path)}")
        n, pos = self._locate(path)
        return n.count if n is not None else int(pos >= 0)

    def _locate(self, path: Sequence[int]) -> tuple[_Node | None, int]:
        """(node, -1) for a materialised path, (None, position after it) for a path seen once,
        (None, -1) for an absent one."""
        n = self.root
        for i, y in enumerate(path):
            c = n.kid if n.tok == y else (n.kids.get(y) if n.kids is not None else None)
            if c is None:
                return None, -1
            if type(c) is _Node:
                n = c
                continue
            s, o = self._seqs[c >> _SHIFT], c & _MASK
            rest = path[i + 1:]
            same = list(s[o + 1:o + 1 + len(rest)]) == list(rest)
            return None, (c + 1 + len(rest) if same else -1)
        return n, -1


@dataclass(frozen=True)
class SuffixConfig:
    """SuffixDecoding parameters; the defaults are vLLM's suffix-decoding defaults.

    max_depth 24 bounds match length + draft length, and memory (paths are cut at 24 tokens).
    factor/offset 1.0/0.0: a match of m tokens drafts at most m tokens, so a one-token
    coincidence never buys a long draft. min_token_prob 0.1: stop once the path probability
    (the estimated chance that every draft token so far is accepted) drops below 10%.
    max_sequences 10k finished outputs, FIFO; max_tokens optionally bounds their total length.
    tag_scoped (the default) keeps one global tree per tag (tenant) instead of one shared tree.
    """

    max_depth: int = 24
    max_spec_factor: float = 1.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1
    max_sequences: int = 10_000
    max_tokens: int | None = None
    tag_scoped: bool = True  # one global tree per tag: a request drafts only from its tag's outputs
    include_prompt: bool = False  # cache prompt + output of a request (default: its output, as SuffixDecoding)

    def __post_init__(self) -> None:
        if self.max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {self.max_depth}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")
        if self.max_spec_factor < 0:
            raise ValueError(f"max_spec_factor must be >= 0, got {self.max_spec_factor}")


@dataclass
class _Request:
    tree: SuffixTree  # the request's own prompt + output
    uid: int
    tokens: list[int]  # that sequence (owned by tree)
    tag: str | None
    gtree: SuffixTree | None = None  # the global tree `gstate` was matched against
    gepoch: int = -1
    gfed: int = 0  # tokens of `tokens` fed into gstate
    gstate: State | None = None


class SuffixCache(SnapshotMixin):
    """SuffixDecoding's two trees: a global one over finished outputs (bounded FIFO; one tree
    per tag when config.tag_scoped) and one per active request over its prompt and output so far.

    Lifecycle per request: start_request -> (add_tokens | speculate)* -> stop_request; each
    raises ValueError on misuse (unknown request, double start). Global updates
    (add_sequence) may come from another thread: one lock serialises every call, and an
    add_sequence (or eviction) takes it per chunk of 32 tokens, so a reader waits at most
    O(32 * max_depth) steps; between chunks the tree holds a prefix of the sequence being
    added (or a suffix of the one being evicted), which is a valid cache state.

    Tag scoping (config.tag_scoped): a request started with tag T drafts only from sequences
    added with tag T (None is a tag of its own), so one tenant's outputs never reach another's
    drafts. Unscoped, tags are kept (snapshots carry them) but every request reads one tree.
    """

    CONFIG = SuffixConfig
    SNAPSHOT_KIND = "suffix"

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self._init_sequences(config or SuffixConfig())
        self._trees: dict[str | None, SuffixTree] = {}
        self._requests: dict[str, _Request] = {}

    # -- global (add_sequence / write_through / confirm: SnapshotMixin) -----------------------

    def _insert(self, toks: tuple[int, ...], tag: str | None) -> int:
        key = self._key(tag)
        with self._lock:
            tree = self._trees.get(key)
            if tree is None:
                tree = self._trees[key] = SuffixTree(self.config.max_depth)
            uid = tree.open()
        for i in range(0, len(toks), _CHUNK):  # readers wait for one chunk at most
            with self._lock:
                tree.extend(uid, toks[i:i + _CHUNK])
        with self._lock:
            tree.close(uid, toks)
        return uid

    def _remove(self, old: LoggedSequence) -> None:
        key = self._key(old.tag)
        tree, n = self._trees[key], len(old.tokens)
        for s in range(0, n, _CHUNK):
            with self._lock:
                tree.remove(old.handle, s, s + _CHUNK)
        with self._lock:
            if not len(tree):
                del self._trees[key]

    # -- per request ----------------------------------------------------------------------

    def start_request(self, req_id: str, prompt_ids: Sequence[int], *, tag: str | None = None) -> None:
        toks = intern_tokens(prompt_ids)
        with self._lock:
            if req_id in self._requests:
                raise ValueError(f"request {req_id!r} already started: stop_request it first")
            tree = SuffixTree(self.config.max_depth)
            uid = tree.open()
            tree.extend(uid, toks)
            self._requests[req_id] = _Request(tree, uid, tree._seqs[uid], tag)

    def add_tokens(self, req_id: str, token_ids: Sequence[int]) -> None:
        """Appends generated tokens to the request's own tree."""
        toks = intern_tokens(token_ids)
        with self._lock:
            st = self._get(req_id)
            st.tree.extend(st.uid, toks)

    def request_tag(self, req_id: str) -> str | None:
        with self._lock:
            return self._get(req_id).tag

    def request_tokens(self, req_id: str) -> list[int]:
        """The request's prompt + output as the cache has seen them (do not mutate)."""
        with self._lock:
            return self._get(req_id).tokens

    def speculate(self, req_id: str, max_tokens: int) -> Speculation:
        """Best draft continuing the request's tokens, from its own tree or the global one
        (its tag's); the request's own tree wins ties."""
        cfg = self.config
        with self._lock:
            st = self._get(req_id)
            if max_tokens <= 0:
                return Speculation()
            args = (max_tokens, cfg.max_spec_factor, cfg.max_spec_offset, cfg.min_token_prob)
            best = st.tree.speculate(st.tree.open_state(st.uid), *args)
            best.origin = "request" if best.tokens else ""
            tree = self._trees.get(self._key(st.tag))
            if tree is not None:
                glob = tree.speculate(self._global_state(st, tree), *args)
                if glob.score > best.score + _TIE:
                    best, glob.origin = glob, "global"
            return best

    def stop_request(self, req_id: str) -> None:
        with self._lock:
            if self._requests.pop(req_id, None) is None:
                raise ValueError(f"request {req_id!r} was not started")

    @property
    def active_requests(self) -> list[str]:
        return list(self._requests)

    def _get(self, req_id: str) -> _Request:
        try:
            return self._requests[req_id]
        except KeyError:
            raise ValueError(f"request {req_id!r} was not started: call start_request first") from None

    def _global_state(self, st: _Request, tree: SuffixTree) -> State:
        """The request's match against `tree`, fed incrementally while the tree is unchanged."""
        toks, depth = st.tokens, tree.max_depth
        if st.gtree is tree and st.gepoch == tree.epoch and len(toks) - st.gfed <= depth:
            state = tree.match(toks[st.gfed:], st.gstate)
        else:
            state = tree.match(toks[-depth:])
        st.gtree, st.gepoch, st.gfed, st.gstate = tree, tree.epoch, len(toks), state
        return state
