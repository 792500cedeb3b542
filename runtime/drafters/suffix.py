"""Model-free drafters over the shared caches: SuffixDrafter (SuffixDecoding) and NGramDrafter.

Both draft from the global structure, which the traffic log keeps up to date
(online/cache tails the stream into it, so every replica drafts from the same
materialised view), and both write through as SuffixDecoding does: when a request
ends normally, its output enters the replica's global structure at once, so the
next request drafts from it without waiting for the stream (the stream's copy of
that trace later confirms it instead of counting it twice). The engine's context is
the truth: `propose` brings the per-request state up to the context it is given.
"""

from __future__ import annotations

from runtime.drafters.base import Draft, DraftRow, RowwiseDrafter
from runtime.drafters.ngram import NGramTable
from runtime.drafters.suffix_tree import Speculation, SuffixCache


class SuffixDrafter(RowwiseDrafter):
    """Best of the request's own suffix tree (prompt + output) and the global cache of
    earlier outputs (the request's tag's tree only). Draft.source is "suffix"."""

    def __init__(self, cache: SuffixCache | None = None, version: str = "suffix", *,
                 write_through: bool = True) -> None:
        self.cache = cache if cache is not None else SuffixCache()
        self.version = version
        self.write_through = write_through
        self._prompt_len: dict[str, int] = {}

    def begin(self, req_id: str, prompt_ids: list[int], *, tag: str | None = None) -> None:
        """Raises ValueError if `req_id` is already active."""
        self.cache.start_request(req_id, prompt_ids, tag=tag)
        self._prompt_len[req_id] = len(prompt_ids)

    def speculate(self, req_id: str, context_ids: list[int], max_tokens: int) -> Speculation:
        """The draft with its score (expected accepted tokens); ValueError if not begun."""
        self._sync(req_id, context_ids)
        return self.cache.speculate(req_id, max_tokens)

    def propose_row(self, row: DraftRow) -> Draft:
        return Draft(self.speculate(row.req_id, row.context, row.max_tokens).tokens, "suffix")

    def end(self, req_id: str, output_ids: list[int] | None = None) -> None:
        """Stops the request; with `output_ids` (it finished normally) writes its output through
        to the global tree under the request's tag."""
        plen = self._prompt_len.pop(req_id, None)
        if req_id not in self.cache.active_requests:
            return
        tag = self.cache.request_tag(req_id)
        prompt = self.cache.request_tokens(req_id)[:plen]
        self.cache.stop_request(req_id)
        if output_ids is not None and self.write_through:
            self.cache.write_through(req_id, self.cache.cached_tokens(prompt, output_ids), tag)

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


class NGramDrafter(RowwiseDrafter):
    """Greedy chain over the n-gram table of logged traffic (Token Recycling / lookahead
    style), scoped to the request's tag. Draft.source is "ngram"."""

    def __init__(self, table: NGramTable | None = None, version: str = "ngram", *,
                 write_through: bool = True) -> None:
        self.table = table if table is not None else NGramTable()
        self.version = version
        self.write_through = write_through
        self._requests: dict[str, tuple[str | None, list[int]]] = {}  # req_id -> (tag, prompt)

    def begin(self, req_id: str, prompt_ids: list[int], *, tag: str | None = None) -> None:
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} already begun")
        self._requests[req_id] = (tag, list(prompt_ids))

    def speculate(self, req_id: str, context_ids: list[int], max_tokens: int) -> Speculation:
        return self.table.speculate(context_ids, max_tokens, tag=self._get(req_id)[0])

    def propose_row(self, row: DraftRow) -> Draft:
        return Draft(self.speculate(row.req_id, row.context, row.max_tokens).tokens, "ngram")

    def end(self, req_id: str, output_ids: list[int] | None = None) -> None:
        """Forgets the request; with `output_ids`, writes its output through to the table."""
        st = self._requests.pop(req_id, None)
        if st is not None and output_ids is not None and self.write_through:
            tag, prompt = st
            self.table.write_through(req_id, self.table.cached_tokens(prompt, output_ids), tag)

    def _get(self, req_id: str) -> tuple[str | None, list[int]]:
        try:
            return self._requests[req_id]
        except KeyError:
            raise ValueError(f"request {req_id!r} was not begun") from None
