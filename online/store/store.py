"""The SQL store: the traffic log (traces), dead letters, and the embedded stream's tables.

One `Store` per process and URL; it is thread-safe (a SQLAlchemy engine with a pool).
SQLite (the default, one file under the data directory, WAL mode) and PostgreSQL run
the same models and migrations. Writes are idempotent on `event_id`, so a redelivered
batch writes nothing twice. Store ids are offsets: increasing in commit order, with
gaps (a skipped duplicate or a rolled-back insert can consume an id).
"""

from __future__ import annotations

import logging
import math
import sqlite3
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError
from sqlalchemy.pool import StaticPool

from online.store import models as m
from online.store.migrate import current_revision, head_revision, upgrade_db
from online.stream.events import decode_trace, encode_trace
from online.trainer.windows import HOLDOUTS, NotEnoughData, TraceWindow, split_stable
from runtime.errors import LivedraftError
from runtime.trace import RequestTrace

log = logging.getLogger(__name__)

__all__ = ["DeadLetterIn", "DeadLetterRow", "Store", "StoreError", "WriteResult", "trace_problem"]

# Writers on PostgreSQL take this transaction-scoped advisory lock, so sequence ids are
# assigned in commit order and an `id > cursor` reader never skips a late-committing row.
_PG_WRITE_LOCK = {"traces": 0x6C64_7472, "stream_events": 0x6C64_7374}


class StoreError(LivedraftError, ValueError):
    """A store URL that does not work, an unreachable database, or a bad query argument."""


@dataclass(frozen=True)
class DeadLetterIn:
    """A record to dead-letter: its raw bytes, why, and where it came from.

    With an `offset`, (source, partition, offset) identifies the record, and a redelivered
    one is stored once; `partition` then defaults to 0 (single-partition sources).
    """

    payload: bytes
    reason: str
    source: str = ""
    partition: int | None = None
    offset: int | None = None


@dataclass(frozen=True)
class DeadLetterRow:
    id: int
    at: float
    reason: str
    source: str
    partition: int | None
    offset: int | None
    payload: bytes


@dataclass(frozen=True)
class WriteResult:
    inserted: int  # new traces
    duplicates: int  # traces whose event_id was already stored (or repeated in the batch)
    dead_letters: int  # new dead letters


class Store:
    """Open with `Store.open(url)`; close with `close()` (or use it as a context manager)."""

    def __init__(self, engine: sa.Engine) -> None:
        self.engine = engine
        name = engine.dialect.name
        if name not in ("sqlite", "postgresql"):
            raise StoreError(f"unsupported database {name!r}: use a sqlite:/// or postgresql+psycopg:// URL")
        self._insert = sqlite.insert if name == "sqlite" else postgresql.insert

    # ---- lifecycle -------------------------------------------------------------------

    @classmethod
    def open(cls, url: str, *, upgrade: bool = True) -> Store:
        """Connects to `url` and (by default) migrates its schema to head.

        For a SQLite file it creates the parent directory and turns on WAL and a 30 s
        busy timeout (writers from several processes wait instead of failing).
        Raises StoreError on a bad URL or an unreachable database, MigrationError when the
        database was migrated by a newer livedraft.
        """
        store = cls(_create_engine(url))
        try:
            with store.engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
        except OperationalError as e:
            store.close()
            raise StoreError(f"cannot connect to the store at {store.url}: {e.orig}") from None
        if upgrade:
            try:
                store.upgrade()
            except BaseException:
                store.close()
                raise
        return store

    @property
    def url(self) -> str:
        """The URL with any password masked."""
        return self.engine.url.render_as_string(hide_password=True)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def upgrade(self) -> None:
        """Runs the migrations up to head (a no-op when already there)."""
        before = upgrade_db(self.engine)
        if before != head_revision():
            log.info("store %s migrated %s -> %s", self.url, before or "empty", head_revision())

    def revision(self) -> str | None:
        """The schema revision of the database (None when never migrated)."""
        return current_revision(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def insert(self, table: sa.Table) -> Any:
        """A dialect INSERT (with on_conflict_* methods) for `table`."""
        return self._insert(table)

    def lock_for_append(self, conn: sa.Connection, table: str) -> None:
        """Inside a write transaction on `table`: on PostgreSQL, serialise with the other
        writers so ids commit in order (SQLite writers are serialised already)."""
        if self.dialect == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_WRITE_LOCK[table]})

    # ---- writes ----------------------------------------------------------------------

    def write_traces(self, traces: Sequence[RequestTrace], *, payloads: Sequence[bytes] | None = None) -> int:
        """Stores `traces` in one transaction, skipping event_ids already stored; returns
        how many rows were inserted. `payloads` (the traces' wire bytes, when the caller
        has them) saves re-encoding. Blocks for the transaction."""
        return self.write_batch(traces, payloads=payloads).inserted

    def write_dead_letter(self, payload: bytes, reason: str, *, source: str = "",
                          partition: int | None = None, offset: int | None = None) -> None:
        """Keeps an undecodable record with the reason (once per source/partition/offset)."""
        self.write_batch([], dead_letters=[DeadLetterIn(payload, reason, source, partition, offset)])

    def write_batch(self, traces: Sequence[RequestTrace], *, payloads: Sequence[bytes] | None = None,
                    dead_letters: Sequence[DeadLetterIn] = ()) -> WriteResult:
        """Traces and dead letters of one consumed batch, in one transaction (all or nothing).
        Raises StoreError, writing nothing, when a trace fails `trace_problem`."""
        if payloads is not None and len(payloads) != len(traces):
            raise StoreError(f"{len(payloads)} payloads for {len(traces)} traces")
        rows = [_trace_row(t, payloads[i] if payloads is not None else None) for i, t in enumerate(traces)]
        for t, row in zip(traces, rows, strict=True):
            if problem := _row_problem(t, row):
                raise StoreError(f"trace {t.event_id[:80]!r} cannot be stored: {problem}")
        inserted = dead = 0
        with self.engine.begin() as conn:
            if rows:
                self.lock_for_append(conn, "traces")
                t = m.Trace.__table__
                stmt = (self._insert(t).on_conflict_do_nothing(index_elements=["event_id"])
                        .returning(t.c.target_model, t.c.drafter_version, t.c.finished_at))
                new = conn.execute(stmt, rows).all()
                inserted = len(new)
                if new:
                    self._count_drafters(conn, new)
            if dead_letters:
                d = m.DeadLetter.__table__
                now = time.time()
                stmt = self._insert(d).on_conflict_do_nothing().returning(d.c.id)
                dead = len(conn.execute(stmt, [
                    {"at": now, "reason": _text(x.reason, 4000), "source": _text(x.source, 256),
                     "partition": x.partition, "offset": x.offset, "payload": x.payload}
                    for x in map(_positioned, dead_letters)]).all())
        return WriteResult(inserted, len(rows) - inserted, dead)

    def _count_drafters(self, conn: sa.Connection, new: Sequence[sa.Row]) -> None:
        seen: dict[tuple[str, str], list[float]] = {}
        for model, version, at in new:
            s = seen.setdefault((model, version), [at, at, 0])
            s[0], s[1], s[2] = min(s[0], at), max(s[1], at), s[2] + 1
        t = m.DrafterVersion.__table__
        stmt = self._insert(t).values([
            {"target_model": k[0], "version": k[1], "first_seen_at": v[0], "last_seen_at": v[1], "traces": v[2]}
            for k, v in sorted(seen.items())])
        ex = stmt.excluded
        stmt = stmt.on_conflict_do_update(index_elements=["target_model", "version"], set_={
            "traces": t.c.traces + ex.traces,
            "first_seen_at": sa.case((ex.first_seen_at < t.c.first_seen_at, ex.first_seen_at), else_=t.c.first_seen_at),
            "last_seen_at": sa.case((ex.last_seen_at > t.c.last_seen_at, ex.last_seen_at), else_=t.c.last_seen_at),
        })
        conn.execute(stmt)

    # ---- reads -----------------------------------------------------------------------

    def count(self, tag: str | None = None, after_id: int = 0) -> int:
        """Traces with id > `after_id` (and the given tag)."""
        t = m.Trace.__table__
        q = sa.select(sa.func.count()).select_from(t).where(t.c.id > after_id)
        if tag is not None:
            q = q.where(t.c.tag == tag)
        with self.engine.connect() as conn:
            return int(conn.execute(q).scalar_one())

    def max_id(self) -> int:
        """The newest trace's id (0 when empty)."""
        t = m.Trace.__table__
        with self.engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.coalesce(sa.func.max(t.c.id), 0))).scalar_one())

    def window(self, *, limit: int | None = None, since: float | None = None, until: float | None = None,
               tag: str | None = None, after_id: int = 0, before_id: int | None = None) -> list[RequestTrace]:
        """Traces oldest first (store order): with `limit`, the most recent `limit` that match.

        `since`/`until` bound `created_at` (seconds since the epoch, [since, until));
        `after_id`/`before_id` bound the store id (exclusive both ends); `tag` must match.
        """
        return [t for _, t in self._window_rows(limit, since, until, tag, after_id, before_id)]

    def training_window(self, limit: int, holdout: int, *, tag: str | None = None,
                        since: float | None = None, until: float | None = None, mode: str = "newest") -> TraceWindow:
        """The most recent `limit` matching traces, split so that the newest `holdout` of them
        are held out (never in `train`), or with `mode` "stable" one in every `limit / holdout`
        (rounded) by a hash of the request id, wherever it lies in the window (online.trainer.windows.
        held_for_life). start/end are the first and last store ids.
        Raises NotEnoughData when at most `holdout` traces match, or (stable) either side is empty."""

        if holdout < 1 or limit <= holdout:
            raise StoreError(f"training window needs 1 <= holdout < limit, got limit={limit} holdout={holdout}")
        if mode not in HOLDOUTS:
            raise StoreError(f"unknown holdout {mode!r}: one of {', '.join(HOLDOUTS)}")
        rows = self._window_rows(limit, since, until, tag, 0, None)
        if len(rows) <= holdout:
            raise NotEnoughData(f"{len(rows)} matching traces in the store, need more than holdout={holdout}: "
                                "wait for more traffic or lower the holdout")
        traces = [t for _, t in rows]
        if mode == "stable":
            return split_stable(traces, max(2, round(limit / holdout)), start=rows[0][0], end=rows[-1][0])
        return TraceWindow(traces[:-holdout], traces[-holdout:], rows[0][0], rows[-1][0])

    def iter_window(self, *, limit: int | None = None, since: float | None = None, until: float | None = None,
                    tag: str | None = None, after_id: int = 0, before_id: int | None = None,
                    batch_size: int = 1000) -> Iterator[RequestTrace]:
        """The traces `window()` returns, read `batch_size` at a time so memory stays flat
        (exports). Traces stored after the call starts are not included."""
        t = m.Trace.__table__
        if before_id is None:
            before_id = self.max_id() + 1
        if limit is not None:
            if limit <= 0:
                return
            q = _filtered(sa.select(t.c.id), since, until, tag, after_id, before_id)
            with self.engine.connect() as conn:
                first = conn.execute(q.order_by(t.c.id.desc()).offset(limit - 1).limit(1)).scalar()
            if first is not None:
                after_id = max(after_id, first - 1)
        while True:
            q = _filtered(sa.select(t.c.id, t.c.payload), since, until, tag, after_id, before_id)
            with self.engine.connect() as conn:
                rows = conn.execute(q.order_by(t.c.id).limit(batch_size)).all()
            yield from (decode_trace(p) for _, p in rows)
            if len(rows) < batch_size:
                return
            after_id = rows[-1][0]

    def _window_rows(self, limit: int | None, since: float | None, until: float | None, tag: str | None,
                     after_id: int, before_id: int | None) -> list[tuple[int, RequestTrace]]:
        if limit is not None and limit < 0:
            raise StoreError(f"limit must be >= 0, got {limit}")
        t = m.Trace.__table__
        q = _filtered(sa.select(t.c.id, t.c.payload), since, until, tag, after_id, before_id)
        q = q.order_by(t.c.id.desc()).limit(limit) if limit is not None else q.order_by(t.c.id)
        with self.engine.connect() as conn:
            rows = conn.execute(q).all()
        if limit is not None:
            rows.reverse()
        return [(i, decode_trace(p)) for i, p in rows]

    def dead_letters(self, limit: int = 100) -> list[DeadLetterRow]:
        """The newest `limit` dead letters, newest first."""
        d = m.DeadLetter.__table__
        q = sa.select(d).order_by(d.c.id.desc()).limit(limit)
        with self.engine.connect() as conn:
            return [DeadLetterRow(r.id, r.at, r.reason, r.source, r.partition, r.offset, r.payload)
                    for r in conn.execute(q)]

    def drafter_versions(self) -> list[dict[str, Any]]:
        """Every (target_model, version) seen, with first/last seen and trace counts."""
        d = m.DrafterVersion.__table__
        with self.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(sa.select(d).order_by(d.c.first_seen_at))]


_STR_LIMITS = {c.name: c.type.length for c in m.Trace.__table__.columns
               if isinstance(c.type, sa.String) and c.type.length}
_NUMBERS = {c.name: c.type for c in m.Trace.__table__.columns
            if isinstance(c.type, (sa.Integer, sa.Float)) and not c.primary_key}
_INT64 = (-(2**63), 2**63 - 1)
_INT32 = (-(2**31), 2**31 - 1)


def trace_problem(t: RequestTrace) -> str | None:
    """Why `t` cannot be stored on every supported database (None when it can): strings
    longer than their columns or containing NUL (PostgreSQL rejects both), numbers out of
    their column's range (integers too large, NaN or infinite floats, a sum of draft counts
    included). The collector dead-letters such traces instead of failing the batch."""
    return _row_problem(t, _trace_row(t, b""))


def _row_problem(t: RequestTrace, row: dict[str, Any]) -> str | None:
    """trace_problem over `row`, `t`'s row as _trace_row made it."""
    for name, limit in _STR_LIMITS.items():
        v = getattr(t, name)
        if v is None:
            continue
        if len(v) > limit:
            return f"{name} is {len(v)} characters, the store keeps at most {limit}"
        if "\x00" in v:
            return f"{name} contains a NUL character"
    for name, kind in _NUMBERS.items():
        v = row[name]
        if v is None:
            continue
        if not isinstance(v, int | float) or isinstance(v, bool):
            return f"{name} is {type(v).__name__}, not a number"
        if isinstance(kind, sa.Float):
            if not math.isfinite(v):  # SQLite stores NaN as NULL, PostgreSQL keeps it: neither is a time or a rate
                return f"{name} is {v}, not a finite number"
        elif isinstance(kind, sa.BigInteger):
            if not _INT64[0] <= v <= _INT64[1]:
                return f"{name} {v} does not fit a signed 64-bit integer"
        elif not _INT32[0] <= v <= _INT32[1]:
            return f"{name} {v} does not fit a 32-bit integer"
    return None


def _filtered(q: sa.Select, since: float | None, until: float | None, tag: str | None,
              after_id: int, before_id: int | None) -> sa.Select:
    t = m.Trace.__table__
    q = q.where(t.c.id > after_id)
    if before_id is not None:
        q = q.where(t.c.id < before_id)
    if since is not None:
        q = q.where(t.c.created_at >= since)
    if until is not None:
        q = q.where(t.c.created_at < until)
    if tag is not None:
        q = q.where(t.c.tag == tag)
    return q


def _text(v: str, limit: int) -> str:
    """`v` as PostgreSQL accepts it in a column of `limit` characters (no NUL)."""
    return v.replace("\x00", "\\x00")[:limit]


def _positioned(x: DeadLetterIn) -> DeadLetterIn:
    if x.offset is not None and x.partition is None:  # NULLs never conflict: give it a partition
        return DeadLetterIn(x.payload, x.reason, x.source, 0, x.offset)
    return x


def _trace_row(t: RequestTrace, payload: bytes | None) -> dict[str, Any]:
    return {
        "event_id": t.event_id, "request_id": t.request_id, "trace_id": t.trace_id,
        "schema_version": t.schema_version, "tag": t.tag, "target_model": t.target_model,
        "drafter_version": t.drafter_version, "temperature": t.temperature, "top_p": t.top_p,
        "seed": t.seed, "max_new_tokens": t.max_new_tokens, "finish_reason": t.finish_reason,
        "created_at": t.created_at, "finished_at": t.finished_at,
        "prompt_tokens": len(t.prompt_ids), "output_tokens": len(t.output_ids), "steps": (c := t.totals).steps,
        "drafted": c.drafted, "accepted": c.accepted,
        "payload": payload if payload is not None else encode_trace(t),
    }


def _create_engine(url: str) -> sa.Engine:
    try:
        u = make_url(url)
    except ArgumentError as e:
        raise StoreError(f"store URL {url!r} is not a database URL: {e}") from None
    kw: dict[str, Any] = {}
    if u.get_backend_name() == "sqlite":
        db = u.database or ""
        if db in ("", ":memory:"):
            kw.update(poolclass=StaticPool, connect_args={"check_same_thread": False})
        elif not db.startswith("file:"):
            path = Path(db).expanduser()
            path.parent.mkdir(parents=True, exist_ok=True)
            u = u.set(database=str(path))
            kw["connect_args"] = {"timeout": 30.0, "check_same_thread": False}
    else:
        kw["pool_pre_ping"] = True
    try:
        engine = sa.create_engine(u, **kw)
    except (ArgumentError, NoSuchModuleError, ImportError) as e:
        raise StoreError(f"cannot use store URL {u.render_as_string(hide_password=True)}: {e} "
                         "(PostgreSQL needs `pip install 'psycopg[binary]'` and a postgresql+psycopg:// URL)") from None
    if engine.dialect.name == "sqlite":
        sa.event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    try:
        cur.execute("PRAGMA busy_timeout=30000")
        # WAL: readers never block the writer, and vice versa. The mode is stored in the
        # file, so only the first opener of a new file switches it. That switch needs an
        # exclusive lock and SQLite does not always run the busy handler for it, so
        # several processes creating the same file at once may see "database is locked":
        # retry for as long as the busy timeout would have waited.
        # An in-memory database has no WAL ("memory" stays): one try, then it keeps its mode.
        deadline = time.monotonic() + 30.0
        while cur.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
            try:
                cur.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
    finally:
        cur.close()
