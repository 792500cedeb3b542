"""PromptLookupDrafter: n-gram match in the request's own context (HF prompt lookup).

The last n tokens of the context (n from max_ngram down to min_ngram) are
looked up among earlier positions of the same context; the tokens that
followed the most recent earlier occurrence are the draft. The index is
updated incrementally, O(new tokens) per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.drafters.base import Draft, DraftRow, RowwiseDrafter


@dataclass
class _Request:
    # ngram tuple -> continuation start of its most recent occurrence, for
    # occurrences whose continuation start is < len(context) (never the suffix itself)
    index: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed_upto: int = 0  # continuation starts < this are indexed


class PromptLookupDrafter(RowwiseDrafter):
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, version: str = "lookup") -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.version = max_ngram, min_ngram, version
        self._requests: dict[str, _Request] = {}

    def begin(self, req_id: str, prompt_ids: list[int], *, tag: str | None = None) -> None:
        """`tag` is not needed: the drafter reads only the request's own context."""
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} already begun")
        self._requests[req_id] = _Request()

    def propose_row(self, row: DraftRow) -> Draft:
        st = self._get(row.req_id)
        context_ids, max_tokens = row.context, row.max_tokens
        self._index(st, context_ids)
        L = len(context_ids)
        if max_tokens <= 0:
            return Draft([], "lookup")
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            start = st.index.get(tuple(context_ids[L - n:]))
            if start is not None:
                return Draft(list(context_ids[start:start + max_tokens]), "lookup")
        return Draft([], "lookup")

    def end(self, req_id: str, output_ids: list[int] | None = None) -> None:
        self._requests.pop(req_id, None)

    def _get(self, req_id: str) -> _Request:
        try:
            return self._requests[req_id]
        except KeyError:
            raise ValueError(f"request {req_id!r} was not begun") from None

    def _index(self, st: _Request, ctx: list[int]) -> None:
        # Continuation start e is indexable once e < len(ctx): the n-gram ctx[e-n:e]
        # was followed by ctx[e].
        for e in range(max(st.indexed_upto, 1), len(ctx)):
            for n in range(self.min_ngram, min(self.max_ngram, e) + 1):
                st.index[tuple(ctx[e - n:e])] = e
        st.indexed_upto = max(st.indexed_upto, len(ctx))
