"""RegistryDrafterSource: the runtime's `DrafterSource` over the MLflow `champion` alias.

The hot-swapper polls `current()` every few seconds (one registry read, no
download), calls `load()` in its watcher thread when the champion moved
(download into the local cache + load the drafter, model or eagle), and reports a
post-swap collapse through `report_rollback()` (tag the version, move
`champion` back to `previous`). Drafters it loads carry the registry version
as their `version`, so traces name the version that served them.
"""

from __future__ import annotations

import logging
import time

from online.registry import DrafterRegistry
from runtime.drafters.base import Drafter
from runtime.drafters.factory import load_drafter
from runtime.errors import LivedraftError
from runtime.hotswap import DrafterRef
from runtime.loader import LoadedModel

log = logging.getLogger(__name__)


class RegistryDrafterSource:
    """Implements runtime.hotswap.DrafterSource. `target` None skips the vocabulary check (replay)."""

    def __init__(self, registry: DrafterRegistry, target: LoadedModel | None, *, warn_every_s: float = 60.0) -> None:
        self.registry = registry
        self.target = target
        self.failures = 0  # transient failures of current() (store unreachable, ...)
        self._warn_every_s = warn_every_s
        self._last_warning = float("-inf")

    def ref(self, version: int) -> DrafterRef:
        return DrafterRef(str(version), f"models:/{self.registry.name}/{version}")

    def current(self) -> DrafterRef | None:
        """The champion's ref, or None when there is none or the store cannot be read (never raises)."""
        try:
            version = self.registry.champion_version()
        except Exception as e:  # a tracking server restart must not stop serving
            self.failures += 1
            now = time.monotonic()
            if now - self._last_warning >= self._warn_every_s:
                self._last_warning = now
                log.warning("drafter source: cannot read the champion of %s (%d failures so far): %s",
                            self.registry.name, self.failures, e)
            return None
        return None if version is None else self.ref(version)

    def load(self, ref: DrafterRef) -> Drafter:
        """Downloads version `ref.version` (cached) and loads it. Blocks; raises LivedraftError
        (a bad version string, a download or load failure) so the swapper skips it."""
        try:
            version = int(ref.version)
        except ValueError:
            raise LivedraftError(f"{ref.version!r} is not a registry version of {self.registry.name}") from None
        path = self.registry.download(version)
        drafter = load_drafter(path, self.target, version=ref.version)
        self.prune()
        return drafter

    def prune(self) -> None:
        """After a load: the registry's cache pruned (DrafterRegistry.prune_cache); a failure is
        logged, never raised (a full disk is no reason to keep serving the old version)."""
        try:
            self.registry.prune_cache()
        except Exception:
            log.exception("drafter source: could not prune the download cache of %s", self.registry.name)

    def load_champion(self) -> tuple[DrafterRef, Drafter]:
        """The champion now, loaded (what a server starts with). Raises RegistryError without one."""
        local = self.registry.champion()
        ref = self.ref(local.version)
        return ref, load_drafter(local.path, self.target, version=ref.version)

    def report_rollback(self, ref: DrafterRef, reason: str, numbers: dict[str, float]) -> bool:
        """Tags the version rolled back and moves `champion` back to `previous`. Logs a failure and
        returns False (the hot-swapper tries again), never raises."""
        try:
            back_to = self.registry.tag_rolled_back(int(ref.version), numbers, reason=reason)
        except Exception:
            log.exception("drafter source: could not record the rollback of %s version %s",
                          self.registry.name, ref.version)
            return False
        log.warning("drafter source: version %s of %s rolled back (%s); champion is now %s",
                    ref.version, self.registry.name, reason, back_to)
        return True
