"""Windows of logged traffic: what a trainer round trains on and the held-out slice that gates it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from runtime.errors import LivedraftError
from runtime.trace import RequestTrace


class NotEnoughData(LivedraftError, ValueError):
    """Too little usable traffic for training or for the promotion gate; retry when more has arrived."""


@dataclass
class TraceWindow:
    """Traces to train on and the held-out slice (newer than all of `train`) that gates promotion."""

    train: list[RequestTrace]
    holdout: list[RequestTrace]
    start: int | None = None  # store offsets of the window, when the source has them
    end: int | None = None

    def describe(self) -> dict[str, Any]:
        """Provenance for drafter metadata and registry tags (JSON-serialisable)."""
        everything = self.train + self.holdout
        return {
            "start": self.start, "end": self.end,
            "train_traces": len(self.train), "holdout_traces": len(self.holdout),
            "first_request_id": everything[0].request_id if everything else None,
            "last_request_id": everything[-1].request_id if everything else None,
            "first_created_at": min((t.created_at for t in everything), default=None),
            "last_finished_at": max((t.finished_at for t in everything), default=None),
        }


class TraceSource(Protocol):
    """Where a round's traces come from (the SQL store, a file, a list in tests)."""

    def window(self) -> TraceWindow:
        """The next window, oldest trace first. Blocks only for the read.
        Raises NotEnoughData when there is not enough new traffic for a round."""
        ...


def split_window(
    traces: Sequence[RequestTrace], holdout_fraction: float, *, start: int | None = None, end: int | None = None
) -> TraceWindow:
    """Holds out the newest `holdout_fraction` of `traces` (given oldest first); at least one each side."""
    if not 0.0 < holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction must be in (0, 1), got {holdout_fraction}")
    if len(traces) < 2:
        raise NotEnoughData(f"a round needs at least 2 traces (train + held out), got {len(traces)}")
    n_hold = min(max(1, round(len(traces) * holdout_fraction)), len(traces) - 1)
    return TraceWindow(list(traces[:-n_hold]), list(traces[-n_hold:]), start, end)
