"""The embedded stream (the default transport): an append-only table in the SQL store.

`stream_events.id` is the record offset (one partition, 0), increasing in commit order;
consumer groups keep their next offset in `consumer_offsets`. Durability is the
database's: an event is acknowledged once its insert committed (`SqlSink.flush`
returned True), and a process kill after that loses nothing (SQLite WAL / PostgreSQL).

A consumer polls the table: in-process appends wake it at once, appends from other
processes are seen within `poll_interval_s`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import sqlalchemy as sa

from online.store import Store
from online.store import models as m
from online.stream import Record
from online.stream.events import encode_trace
from runtime.trace import RequestTrace

if TYPE_CHECKING:
    from online.config import Config

log = logging.getLogger(__name__)

PARTITION = 0
_STOP = object()
_appended = threading.Condition()  # notified after every in-process append commit
_RETRY_DELAYS_S = (0.05, 0.2, 1.0, 3.0)  # a locked or briefly unreachable database, then give up


def append(store: Store, records: Sequence[tuple[str | None, bytes]]) -> list[int]:
    """Appends raw (key, payload) records in one transaction; returns their offsets.

    Blocks for the transaction (use `SqlSink` from a decoding thread). Raises the
    database's error when the insert fails; nothing is appended then.
    """
    if not records:
        return []
    t = m.StreamEvent.__table__
    now = time.time()
    with store.engine.begin() as conn:
        store.lock_for_append(conn, "stream_events")
        ids = conn.execute(store.insert(t).returning(t.c.id, sort_by_parameter_order=True),
                           [{"key": k, "payload": p, "at": now} for k, p in records]).scalars().all()
    with _appended:
        _appended.notify_all()
    return list(ids)


@dataclass
class PruneResult:
    deleted: int  # stream records removed
    floor: int  # the lowest offset any consumer group still needs (nothing at or above it is removed)
    held_by: list[str]  # groups idle longer than the retention that hold old records back


def prune(store: Store, retention_s: float, *, now: float | None = None, chunk: int = 10000,
          stop: threading.Event | None = None) -> PruneResult:
    """Removes records older than `retention_s` that every consumer group has committed past.

    The embedded stream is a transport, not the archive: the collector stores every event
    in the store's tables and cache snapshots carry their own offsets, so consumed records
    only take space. Unlike Kafka's retention, a record no group has consumed yet is kept
    however old (the daemon may have been down longer than the retention), and so is every
    record before the offset of a group that stopped consuming: such groups are reported in
    `held_by` (drop one with `livedraft db drop-group NAME`). Deletes in chunks of `chunk`
    rows, one transaction each, so writers are never locked out for long; `stop` set ends the
    pass after the current chunk.
    """
    if retention_s <= 0:
        raise ValueError(f"retention must be > 0 seconds, got {retention_s}")
    now = time.time() if now is None else now
    cutoff = now - retention_s
    t = m.StreamEvent.__table__
    with store.engine.connect() as conn:
        groups = _group_offsets(conn)
    if not groups:
        return PruneResult(0, 0, [])  # nothing consumed yet: everything is still needed
    floor = min(g.next_offset for g in groups)
    held_by = [g.consumer_group for g in groups if g.next_offset == floor and g.updated_at < cutoff]
    deleted = 0
    while True:
        ids = sa.select(t.c.id).where(t.c.id < floor, t.c.at < cutoff).order_by(t.c.id).limit(chunk)
        with store.engine.begin() as conn:
            n = conn.execute(sa.delete(t).where(t.c.id.in_(ids.scalar_subquery()))).rowcount
        deleted += n
        if n < chunk or (stop is not None and stop.is_set()):
            break
    if deleted:
        log.info("embedded stream: pruned %d records older than %.1f h (consumed by every group)",
                 deleted, retention_s / 3600)
    if held_by:
        log.warning("embedded stream: consumer group(s) %s have not committed for over %.1f h and hold "
                    "records before offset %d back from pruning; drop a group that is gone with "
                    "`livedraft db drop-group NAME`", ", ".join(held_by), retention_s / 3600, floor)
    return PruneResult(deleted, floor, held_by)


def drop_group(store: Store, group: str) -> bool:
    """Forgets consumer group `group`'s offsets (it then no longer holds back pruning).
    True when the group existed."""
    o = m.ConsumerOffset.__table__
    with store.engine.begin() as conn:
        return conn.execute(sa.delete(o).where(o.c.consumer_group == group)).rowcount > 0


def _group_offsets(conn: sa.Connection) -> list[sa.Row]:
    """(consumer_group, next_offset, updated_at) of every group, by name."""
    o = m.ConsumerOffset.__table__
    return conn.execute(sa.select(o.c.consumer_group, o.c.next_offset, o.c.updated_at)
                        .where(o.c.partition == PARTITION).order_by(o.c.consumer_group)).all()


def consumer_groups(store: Store) -> list[dict]:
    """Each group's next offset, lag (records at or after it) and last commit time."""
    t = m.StreamEvent.__table__
    with store.engine.connect() as conn:
        rows = _group_offsets(conn)
        lag = {r.consumer_group: conn.execute(sa.select(sa.func.count()).select_from(t)
                                              .where(t.c.id >= r.next_offset)).scalar() for r in rows}
    return [{"group": r.consumer_group, "next_offset": r.next_offset, "lag": lag[r.consumer_group],
             "updated_at": r.updated_at} for r in rows]


class SqlSink:
    """An EventSink onto the embedded stream: `emit` never blocks (bounded queue, drops
    counted); one writer thread encodes and inserts batches of up to `batch_max` events.

    Counters: `emitted` (accepted into the queue), `dropped` (queue full or closed),
    `failed` (insert failed after retries; logged), `written` (committed).
    """

    def __init__(self, store: Store, *, queue_size: int = 10000, batch_max: int = 500,
                 owns_store: bool = False) -> None:
        self.store = store
        self.batch_max = batch_max
        self.emitted = self.dropped = self.failed = self.written = 0
        self._owns_store = owns_store
        self._closed = False
        self._late_lost = 0  # of `dropped`: events a close gave up on while the writer still held them
        self._queue: queue.Queue[object] = queue.Queue(queue_size)
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="livedraft-sql-sink", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, cfg: Config) -> SqlSink:
        """Opens (and migrates) `stream.sql_url`, else the store URL. Raises StoreError."""
        store = Store.open(cfg.stream_sql_url())
        return cls(store, queue_size=cfg.stream.queue_size, batch_max=cfg.stream.batch_max_records, owns_store=True)

    def emit(self, event: RequestTrace) -> None:
        """Queues `event`; never blocks. Drops (and counts) it when the queue is full."""
        with self._cond:
            if self._closed:
                self.dropped += 1
                return
            try:
                self._queue.put_nowait(event)
            except queue.Full:
                self.dropped += 1
                return
            self.emitted += 1

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Blocks until every event emitted before the call is committed or has failed, at
        most `timeout_s`. True when all of them are committed (acknowledged)."""
        with self._cond:
            target, failed_before = self.emitted, self.failed
            done = self._cond.wait_for(lambda: self.written + self.failed >= target, timeout_s)
            if not done:
                log.warning("sql sink flush timed out after %.1fs: %d events not yet written",
                            timeout_s, target - self.written - self.failed)
            return done and self.failed == failed_before

    def close(self, timeout_s: float = 10.0) -> None:
        """Flushes, stops the writer thread, and closes the store if this sink opened it.
        Blocks up to about 3 x `timeout_s` when the database is stuck; events not written by
        then are counted in `dropped` and logged (lost when the process exits; one the writer
        still commits afterwards moves back to `written`)."""
        ok = self.flush(timeout_s)
        with self._cond:
            self._closed = True
        try:
            self._queue.put(_STOP, timeout=timeout_s)  # room appears as the writer drains
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        with self._cond:
            lost = self.emitted - self.written - self.failed - self._late_lost
            if lost > 0:
                self.dropped += lost
                self._late_lost += lost
        if lost > 0:
            log.error("sql sink closed with %d events not written (the database is stuck?)", lost)
        if self._owns_store and ok and not self._thread.is_alive():
            self.store.close()

    def _run(self) -> None:
        stop = False
        while not stop:
            batch = [self._queue.get()]
            while len(batch) < self.batch_max:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if _STOP in batch:
                stop = True
                batch = [e for e in batch if e is not _STOP]
            if batch:
                self._write(batch)

    def _write(self, batch: list) -> None:
        records, bad = [], 0
        for event in batch:
            try:
                records.append((event.request_id, encode_trace(event)))
            except Exception:
                bad += 1
                log.exception("cannot encode event %r; dropped", getattr(event, "event_id", event))
        written, failed = 0, bad
        for attempt, delay in enumerate((*_RETRY_DELAYS_S, None)):
            try:
                append(self.store, records)
                written = len(records)
                break
            except Exception as e:
                if delay is None:
                    failed += len(records)
                    log.error("sql sink: %d events lost after %d attempts: %s", len(records), attempt + 1, e)
                else:
                    log.warning("sql sink: insert failed (%s); retrying in %.2fs", e, delay)
                    time.sleep(delay)
        with self._cond:
            self.written += written
            self.failed += failed
            late = min(written + failed, self._late_lost)  # counted as dropped by a close that gave up on them
            self._late_lost -= late
            self.dropped -= late
            self._cond.notify_all()


class SqlSource:
    """An EventSource over the embedded stream for consumer group `group`.

    A new group starts at the beginning of the log. `poll` advances a private position;
    `commit` stores it for the group (call it after the batch is durably stored).
    Not thread-safe: one consumer per instance. The embedded stream has one partition, so
    run one collector per group: a second one is safe (every consumer commits only what
    it stored itself; the store de-duplicates) but only repeats the first one's work.
    """

    def __init__(self, store_or_url: Store | str, group: str, *, poll_interval_s: float = 0.05) -> None:
        self._owns_store = isinstance(store_or_url, str)
        self.store = Store.open(store_or_url) if isinstance(store_or_url, str) else store_or_url
        self.group = group
        self.poll_interval_s = poll_interval_s
        self._position = self.committed()

    @classmethod
    def from_config(cls, cfg: Config, group: str) -> SqlSource:
        return cls(cfg.stream_sql_url(), group, poll_interval_s=cfg.stream.sql_poll_interval_s)

    def committed(self) -> int:
        """The group's committed next offset (0 = the beginning of the log)."""
        o = m.ConsumerOffset.__table__
        q = sa.select(o.c.next_offset).where(o.c.consumer_group == self.group, o.c.partition == PARTITION)
        with self.store.engine.connect() as conn:
            return conn.execute(q).scalar() or 0

    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        """Up to `max_records` records from the position on; waits up to `timeout_s` for the
        first one (empty list then). Raises the database's error when it cannot read."""
        t = m.StreamEvent.__table__
        q = (sa.select(t.c.id, t.c.key, t.c.payload, t.c.at).where(t.c.id >= sa.bindparam("pos"))
             .order_by(t.c.id).limit(max_records))
        deadline = time.monotonic() + timeout_s
        while True:
            with self.store.engine.connect() as conn:
                rows = conn.execute(q, {"pos": self._position}).all()
            if rows:
                self._position = rows[-1].id + 1
                return [Record(r.payload, r.key, PARTITION, r.id, r.at) for r in rows]
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            with _appended:
                _appended.wait(min(left, self.poll_interval_s))

    def commit(self) -> None:
        """Stores the position as the group's committed offset (one upsert; blocks for it)."""
        o = m.ConsumerOffset.__table__
        stmt = self.store.insert(o).values(consumer_group=self.group, partition=PARTITION,
                                           next_offset=self._position, updated_at=time.time())
        stmt = stmt.on_conflict_do_update(index_elements=["consumer_group", "partition"],
                                          set_={"next_offset": stmt.excluded.next_offset,
                                                "updated_at": stmt.excluded.updated_at})
        with self.store.engine.begin() as conn:
            conn.execute(stmt)

    def seek(self, offsets: dict[int, int]) -> None:
        """Next poll reads from `offsets[0]` (other partitions do not exist here)."""
        if PARTITION in offsets:
            self._position = offsets[PARTITION]

    def close(self) -> None:
        if self._owns_store:
            self.store.close()
