"""Model-free drafters over the shared caches: SuffixDrafter (SuffixDecoding) and NGramDrafter.

Both only *read* the global structure; it is filled elsewhere (online/cache tails the
traffic log into it), so every replica drafts from the same materialised view. The engine's
context is the truth: `propose` brings the per-request state up to the context it is given
(the engine appends the first token after prefill without an `observe`).
"""

from __future__ import annotations

from runtime.drafters.base import Draft
from runtime.drafters.ngram import NGramTable
from runtime.drafters.suffix_tree import Speculation, SuffixCache


class SuffixDrafter:
    """Best of the request's own suffix tree (prompt + output) and the global cache of
    earlier outputs (the request's tag's tree only). Draft.source is "suffix"."""

    tag_aware = True  # begin() takes tag=: the engine passes the request's tenant tag

    def __init__(self, cache: SuffixCache | None = None, version: str = "suffix") -> None:
        self.cache = cache if cache is not None else SuffixCache()
        self.version = version

    def begin(self, req_id: str, prompt_ids: list[int], *, tag: str | None = None) -> None:
        """Raises ValueError if `req_id` is already active."""
        self.cache.start_request(req_id, prompt_ids, tag=tag)

    def speculate(self, req_id: str, context_ids: list[int], max_tokens: int) -> Speculation:
        """The draft with its score (expected accepted tokens); ValueError if not begun."""
        self._sync(req_id, context_ids)
        return self.cache.speculate(req_id, max_tokens)

    def propose(self, req_id: str, context_ids: list[int], max_tokens: int, **_: object) -> Draft:
        return Draft(self.speculate(req_id, context_ids, max_tokens).tokens, "suffix")

    def observe(self, req_id: str, accepted_ids: list[int], num_accepted: int) -> None:
        self.cache.request_tokens(req_id)  # ValueError if not begun; tokens sync in propose

    def end(self, req_id: str) -> None:
        if req_id in self.cache.active_requests:
            self.cache.stop_request(req_id)

    def _sync(self, req_id: str, context_ids: list[int]) -> None:
        have = self.cache.request_tokens(req_id)
        n = len(have)
        if len(context_ids) >= n and (n == 0 or context_ids[n - 1] == have[-1]):
            if len(context_ids) > n:
                self.cache.add_tokens(req_id, context_ids[n:])
            return
        # The context is not an extension of what we saw (a caller rewound it): start over.
        tag = self.cache.request_tag(req_id)
        self.cache.stop_request(req_id)
        self.cache.start_request(req_id, context_ids, tag=tag)

    def __repr__(self) -> str:
        return f"SuffixDrafter({self.cache.num_sequences} cached sequences)"


class NGramDrafter:
    """Greedy chain over the n-gram table of logged traffic (Token Recycling / lookahead
    style), scoped to the request's tag. Draft.source is "ngram"."""

    tag_aware = True

    def __init__(self, table: NGramTable | None = None, version: str = "ngram") -> None:
        self.table = table if table is not None else NGramTable()
        self.version = version
        self._tags: dict[str, str | None] = {}

    def begin(self, req_id: str, prompt_ids: list[int], *, tag: str | None = None) -> None:
        if req_id in self._tags:
            raise ValueError(f"request {req_id!r} already begun")
        self._tags[req_id] = tag

    def speculate(self, req_id: str, context_ids: list[int], max_tokens: int) -> Speculation:
        return self.table.speculate(context_ids, max_tokens, tag=self._tag(req_id))

    def propose(self, req_id: str, context_ids: list[int], max_tokens: int, **_: object) -> Draft:
        return Draft(self.speculate(req_id, context_ids, max_tokens).tokens, "ngram")

    def observe(self, req_id: str, accepted_ids: list[int], num_accepted: int) -> None:
        self._tag(req_id)

    def end(self, req_id: str) -> None:
        self._tags.pop(req_id, None)

    def _tag(self, req_id: str) -> str | None:
        try:
            return self._tags[req_id]
        except KeyError:
            raise ValueError(f"request {req_id!r} was not begun") from None
