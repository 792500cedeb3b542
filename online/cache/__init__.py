"""Cache maintenance: the shared suffix-tree / n-gram caches (and the cross-vocabulary bridge) kept in step with
the trace stream, snapshotted to <data_dir>/cache/ so replicas start from a snapshot and tail the rest."""

from online.cache.hybrid_source import HybridDrafterSource
from online.cache.maintainer import (
    CacheMaintainer,
    MaintainerStats,
    drafter_config,
    new_bridge,
    new_cache,
    open_maintainer,
    open_replica_cache,
    snapshot_dir,
)
from online.cache.snapshots import (
    LoadedSnapshot,
    load_latest_snapshot,
    snapshot_paths,
    write_snapshot,
)

__all__ = [
    "CacheMaintainer", "HybridDrafterSource", "LoadedSnapshot", "drafter_config", "MaintainerStats",
    "load_latest_snapshot", "new_bridge", "new_cache",
    "open_maintainer", "open_replica_cache", "snapshot_dir", "snapshot_paths", "write_snapshot",
]
