"""The SQL store (online/store/store.py): the traffic log, dead letters, the embedded stream's tables."""

from online.store.store import (
    DeadLetterIn,
    DeadLetterRow,
    Store,
    StoreError,
    WriteResult,
    trace_problem,
)

__all__ = ["DeadLetterIn", "DeadLetterRow", "Store", "StoreError", "WriteResult", "trace_problem"]
