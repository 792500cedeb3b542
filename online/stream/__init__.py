"""Stream transports for RequestTrace events (online/stream/base.py: the contract and the factory)."""

from online.stream.base import (
    STREAM_KINDS,
    EventSinkCloseable,
    EventSource,
    Record,
    open_sink,
    open_source,
)

__all__ = ["Record", "EventSource", "EventSinkCloseable", "open_sink", "open_source", "STREAM_KINDS"]
