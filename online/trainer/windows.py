"""Windows of logged traffic: what a trainer round trains on and the held-out slice that gates it."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from runtime.errors import LivedraftError
from runtime.trace import RequestTrace


class NotEnoughData(LivedraftError, ValueError):
    """Too little usable traffic for training or for the promotion gate; retry when more has arrived."""


# how a window picks the traces that gate a round (daemon.holdout): "newest", the newest of the window; "stable",
# one request in every window_traces / holdout_traces by a hash of its id, held out for life
HOLDOUTS = ("newest", "stable")


@dataclass
class TraceWindow:
    """Traces to train on and the held-out slice that gates promotion, each oldest first: with the
    "newest" holdout the slice is newer than all of `train`; with "stable" it is spread over the window."""

    train: list[RequestTrace]
    holdout: list[RequestTrace]
    start: int | None = None  # store offsets of the window, when the source has them
    end: int | None = None
    # request ids of the window's oldest and newest trace, where train and holdout interleave ("stable")
    edges: tuple[str, str] | None = None
    # not from the log: the target's answers sampled again to some of train's prompts, trained on beside train
    # (trainer.shift_answers: online.trainer.round.ShiftAnswers)
    answers: list[RequestTrace] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        """Provenance for drafter metadata and registry tags (JSON-serialisable)."""
        everything = self.train + self.holdout
        first, last = self.edges or (everything[0].request_id if everything else None,
                                     everything[-1].request_id if everything else None)
        return {
            "start": self.start, "end": self.end,
            "train_traces": len(self.train), "holdout_traces": len(self.holdout), "answer_traces": len(self.answers),
            "first_request_id": first, "last_request_id": last,
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


def held_for_life(request_id: str, every: int) -> bool:
    """The "stable" holdout: whether `request_id` is one of the one-in-`every` requests that no round
    ever trains on (a CRC-32 of the id: the same in every process, round and store)."""
    if every < 2:
        raise ValueError(f"a stable holdout holds out one request in every >= 2, got {every}")
    return zlib.crc32(request_id.encode()) % every == 0


def split_stable(traces: Sequence[RequestTrace], every: int, *, start: int | None = None,
                 end: int | None = None) -> TraceWindow:
    """`traces` (oldest first) split by `held_for_life`: a round trains on the newest traffic too, and a
    trace held out for one round's gate is never trained on by a later round of its lineage.
    Raises NotEnoughData when either side is empty."""
    held = [held_for_life(t.request_id, every) for t in traces]
    train = [t for t, h in zip(traces, held, strict=True) if not h]
    holdout = [t for t, h in zip(traces, held, strict=True) if h]
    if not train or not holdout:
        raise NotEnoughData(f"{len(traces)} traces hold {len(holdout)} of the one in {every} held out for the gate "
                            f"and {len(train)} to train on, need at least one each: wait for more traffic")
    return TraceWindow(train, holdout, start, end, edges=(traces[0].request_id, traces[-1].request_id))
