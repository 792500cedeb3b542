"""VocabBridge: OmniDraft's online n-gram cache, mapping drafter token n-grams to the target tokens
that spelled the same text in the traffic (arXiv 2507.02659 §3).

Like the suffix cache it is a materialised view of the trace log: it holds the last N finished
outputs (target token ids, per tag when `tag_scoped`), and for each one the pieces where both
tokenizations cut the text at the same place (`aligned_segments`) are counted, drafter n-gram
-> target tokens. Eviction un-counts, snapshots hold the outputs (restoring re-adds them), so
replicas fed one stream hold the same bridge; a serving replica writes each finished output
through at once (SnapshotMixin). A lookup takes the longest drafter n-gram at the start of a
draft whose most frequent target spelling was seen at least `min_count` times.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from runtime.drafters.crossvocab import Codec, aligned_segments
from runtime.drafters.seqlog import LoggedSequence, SnapshotMixin


@dataclass(frozen=True)
class BridgeConfig:
    max_n: int = 4  # longest drafter n-gram (and target piece) kept
    min_count: int = 2  # a mapping is used once seen this often
    max_sequences: int = 10_000
    max_tokens: int | None = None
    tag_scoped: bool = True  # one bridge per tag (tenant)
    include_prompt: bool = False

    def __post_init__(self) -> None:
        if self.max_n < 1 or self.min_count < 1:
            raise ValueError(f"max_n and min_count must be >= 1, got {self.max_n}, {self.min_count}")


class VocabBridge(SnapshotMixin):
    """Thread-safe (one lock, as the other caches). Built with both tokenizers; a bridge restored
    from a snapshot without them (`ready` False) must be re-added into one that has them."""

    CONFIG = BridgeConfig
    SNAPSHOT_KIND = "bridge"

    def __init__(self, config: BridgeConfig | None = None, *, target_tokenizer: Any = None,  # noqa: ANN401
                 drafter_tokenizer: Any = None) -> None:
        self._init_sequences(config or BridgeConfig())
        self.t = Codec(target_tokenizer) if target_tokenizer is not None else None
        self.d = Codec(drafter_tokenizer) if drafter_tokenizer is not None else None
        self._maps: dict[str | None, dict[tuple[int, ...], Counter[tuple[int, ...]]]] = {}

    @property
    def ready(self) -> bool:
        return self.t is not None and self.d is not None

    def _segments(self, toks: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        if not self.ready:
            return []
        return aligned_segments(self.t, self.d, toks, self.config.max_n)

    def _insert(self, toks: tuple[int, ...], tag: str | None) -> int:
        pairs = self._segments(toks)
        with self._lock:
            table = self._maps.setdefault(self._key(tag), {})
            for d, t in pairs:
                table.setdefault(d, Counter())[t] += 1
        return -1

    def _remove(self, old: LoggedSequence) -> None:
        pairs = self._segments(old.tokens)
        key = self._key(old.tag)
        with self._lock:
            table = self._maps.get(key, {})
            for d, t in pairs:
                counts = table.get(d)
                if counts is None:
                    continue
                counts[t] -= 1
                if counts[t] <= 0:
                    del counts[t]
                if not counts:
                    del table[d]
            if not table:
                self._maps.pop(key, None)

    def lookup(self, draft: Sequence[int], tag: str | None = None) -> tuple[int, list[int]] | None:
        """(n, target tokens) for the longest drafter n-gram `draft[:n]` the bridge maps, or None."""
        with self._lock:
            table = self._maps.get(self._key(tag))
            if not table:
                return None
            for n in range(min(self.config.max_n, len(draft)), 0, -1):
                counts = table.get(tuple(draft[:n]))
                if counts:
                    target, count = max(counts.items(), key=lambda kv: (kv[1], [-x for x in kv[0]]))
                    if count >= self.config.min_count:
                        return n, list(target)
        return None

    def mappings(self, tag: str | None = None) -> int:
        """How many drafter n-grams the bridge maps for `tag`."""
        with self._lock:
            return len(self._maps.get(self._key(tag), {}))
