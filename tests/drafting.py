"""Test helpers for calling drafters one request at a time."""

from __future__ import annotations

from runtime.drafters.base import Draft, Drafter, DraftRow


def draft(drafter: Drafter, req_id: str, context: list[int], max_tokens: int, **kw: object) -> Draft:
    """`drafter.propose` for one row."""
    return drafter.propose([DraftRow(req_id, list(context), max_tokens, **kw)])[0]
