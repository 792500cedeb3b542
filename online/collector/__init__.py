"""The collector (online/collector/collector.py): stream -> SQL store, exactly once."""

from online.collector.collector import Collector, CollectStats

__all__ = ["CollectStats", "Collector"]
