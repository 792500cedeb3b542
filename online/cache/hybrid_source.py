"""HybridDrafterSource: serve every registry drafter version inside a HybridDrafter.

The hot-swap watcher loads model drafters from a DrafterSource (the registry's champion);
wrapping that source makes each loaded version the model half of a HybridDrafter over the
replica's shared suffix cache, so swaps and rollbacks keep working unchanged:

    replica = open_replica_cache(cfg)
    source = HybridDrafterSource(RegistryDrafterSource(...), replica.cache, cfg.cache.hybrid_threshold)
"""

from __future__ import annotations

from runtime.drafters.base import Drafter
from runtime.drafters.hybrid import HybridDrafter
from runtime.drafters.suffix import SuffixDrafter
from runtime.drafters.suffix_tree import SuffixCache
from runtime.hotswap import DrafterRef, DrafterSource


class HybridDrafterSource:
    def __init__(self, inner: DrafterSource, cache: SuffixCache, threshold: float = 1.0) -> None:
        self.inner, self.cache, self.threshold = inner, cache, threshold

    def current(self) -> DrafterRef | None:
        return self.inner.current()

    def load(self, ref: DrafterRef) -> Drafter:
        """Loads `ref` from the inner source (blocking; raises what it raises) and wraps it."""
        model = self.inner.load(ref)
        return HybridDrafter(SuffixDrafter(self.cache), model, self.threshold)

    def report_rollback(self, ref: DrafterRef, reason: str, numbers: dict[str, float]) -> bool | None:
        return self.inner.report_rollback(ref, reason, numbers)
