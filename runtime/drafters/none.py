"""NoDrafter: plain autoregressive decoding through the same engine (the baseline)."""

from __future__ import annotations

from runtime.drafters.base import Draft, DraftRow, RowwiseDrafter


class NoDrafter(RowwiseDrafter):
    version = "none"

    def begin(self, req_id: str, prompt_ids: list[int], *, tag: str | None = None) -> None:
        pass

    def propose_row(self, row: DraftRow) -> Draft:
        return Draft([], "none")

    def end(self, req_id: str, output_ids: list[int] | None = None) -> None:
        pass

    def __repr__(self) -> str:
        return "NoDrafter()"
