"""NoDrafter: plain autoregressive decoding through the same engine (the baseline)."""

from __future__ import annotations

from runtime.drafters.base import Draft


class NoDrafter:
    version = "none"

    def begin(self, req_id: str, prompt_ids: list[int]) -> None:
        pass

    def propose(self, req_id: str, context_ids: list[int], max_tokens: int, **_: object) -> Draft:
        return Draft([], "none")

    def observe(self, req_id: str, accepted_ids: list[int], num_accepted: int) -> None:
        pass

    def end(self, req_id: str) -> None:
        pass

    def __repr__(self) -> str:
        return "NoDrafter()"
