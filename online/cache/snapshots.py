"""Cache snapshots on disk: atomic writes, newest-first loading with fallback.

A snapshot file is `<kind>-<seq>.snap` (seq increases with every write) holding the
versioned bytes of `SuffixCache.snapshot()` / `NGramTable.snapshot()` / `VocabBridge.snapshot()`: format version,
config, the stream offsets it includes, the cached sequences. It is written to a
temporary file, fsynced, then renamed, so a reader or a crash never sees half a file.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from runtime.drafters.ngram import NGramTable
from runtime.drafters.seqlog import SnapshotError
from runtime.drafters.suffix_tree import SuffixCache
from runtime.drafters.vocab_bridge import VocabBridge

log = logging.getLogger(__name__)

Cache = SuffixCache | NGramTable | VocabBridge
CACHE_CLASSES: dict[str, type[SuffixCache] | type[NGramTable] | type[VocabBridge]] = {
    "suffix": SuffixCache, "ngram": NGramTable, "bridge": VocabBridge}
_NAME = re.compile(r"^(suffix|ngram|bridge)-(\d{12})\.snap$")


@dataclass(frozen=True)
class LoadedSnapshot:
    cache: Cache
    path: Path
    skipped: list[tuple[Path, str]]  # newer snapshots that could not be read, and why


def snapshot_paths(directory: str | os.PathLike, kind: str) -> list[Path]:
    """This kind's snapshot files in `directory`, newest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(2)), p) for p in d.iterdir() if (m := _NAME.match(p.name)) and m.group(1) == kind]
    return [p for _, p in sorted(found, reverse=True)]


def write_snapshot(directory: str | os.PathLike, cache: Cache, *, keep: int = 3) -> Path:
    """Writes `cache.snapshot()` atomically as the newest snapshot; deletes all but the newest
    `keep`. Blocks for the write and fsync; raises OSError when the disk refuses."""
    kind = cache_kind(cache)
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    existing = snapshot_paths(d, kind)
    seq = int(_NAME.match(existing[0].name).group(2)) + 1 if existing else 1
    path = d / f"{kind}-{seq:012d}.snap"
    tmp = d / f".{path.name}.tmp"
    data = cache.snapshot()
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(d)
    for old in snapshot_paths(d, kind)[max(1, keep):]:
        old.unlink(missing_ok=True)
    return path


def load_latest_snapshot(directory: str | os.PathLike, kind: str = "suffix") -> LoadedSnapshot | None:
    """The newest readable snapshot of `kind` (None when there is none). An unreadable one
    (corrupt, truncated, a newer format) is logged and skipped for the one before it."""
    if kind not in CACHE_CLASSES:
        raise SnapshotError(f"unknown cache kind {kind!r}: choose one of {sorted(CACHE_CLASSES)}")
    skipped: list[tuple[Path, str]] = []
    for path in snapshot_paths(directory, kind):
        try:
            cache = CACHE_CLASSES[kind].restore(path.read_bytes())
        except (SnapshotError, OSError) as e:
            log.warning("skipping cache snapshot %s: %s; trying the previous one", path, e)
            skipped.append((path, str(e)))
            continue
        return LoadedSnapshot(cache, path, skipped)
    if skipped:
        log.warning("no readable %s snapshot in %s: the cache is rebuilt from the stream", kind, directory)
    return None


def cache_kind(cache: Cache) -> str:
    """The snapshot kind ("suffix", "ngram", "bridge") of a cache."""
    for kind, cls in CACHE_CLASSES.items():
        if isinstance(cache, cls):
            return kind
    raise TypeError(f"not a cache: {type(cache).__name__}")


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
