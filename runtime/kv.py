"""KV-cache helpers shared by the target and model drafters."""

from __future__ import annotations

from transformers import DynamicCache


def crop_to(cache: DynamicCache, length: int) -> None:
    """Drop cached positions beyond `length` (rollback after a rejection)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)  # transformers 5: a negative count removes that many positions


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
