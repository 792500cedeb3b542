"""SQLAlchemy 2.x models of the project's own database (traffic log, embedded stream).

Models hold no logic; `online.store.Store` and `online.stream.sql` query them.
Migrations in `migrations/versions/` create exactly these tables (a test compares them).

Why a trace is one row with a msgpack blob and not a child table of steps: a 256-token
trace has ~60 verify steps, each with up to 8 soft labels. Readers (replay, trainer,
cache) always load whole traces, never single steps, so a step table would cost ~60x
the rows and inserts for no query it serves. The blob is the wire object from
`online.stream.events` (`payload`), decoded by the same versioned decoder as the stream, so
adding an optional trace field needs no migration. What queries filter or aggregate on
(ids, tag, drafter, model, time, lengths, acceptance counts) are real, indexed columns.

Ids: `traces.id` and `stream_events.id` are monotonically increasing offsets (SQLite
AUTOINCREMENT never reuses one; writers on PostgreSQL serialise on an advisory lock so
ids become visible in order) — cursors like `after_id` never skip a row.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# INTEGER PRIMARY KEY is SQLite's rowid alias (the only autoincrementing type there).
Id = BigInteger().with_variant(Integer(), "sqlite")

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_name)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Trace(Base):
    """One finished request (a RequestTrace); `id` is its store offset."""

    __tablename__ = "traces"
    __table_args__ = (
        Index("ix_traces_tag_id", "tag", "id"),
        {"sqlite_autoincrement": True},
    )

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    event_id: Mapped[str] = mapped_column(String(128), unique=True)
    request_id: Mapped[str] = mapped_column(String(256), index=True)
    trace_id: Mapped[str] = mapped_column(String(128))
    schema_version: Mapped[int] = mapped_column(Integer)
    tag: Mapped[str | None] = mapped_column(String(256))
    target_model: Mapped[str] = mapped_column(String(256))
    drafter_version: Mapped[str] = mapped_column(String(256), index=True)
    temperature: Mapped[float] = mapped_column(Float)
    top_p: Mapped[float] = mapped_column(Float)
    seed: Mapped[int | None] = mapped_column(BigInteger)
    max_new_tokens: Mapped[int] = mapped_column(Integer)
    finish_reason: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float, index=True)  # seconds since the epoch
    finished_at: Mapped[float] = mapped_column(Float)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    output_tokens: Mapped[int] = mapped_column(Integer)
    steps: Mapped[int] = mapped_column(Integer)
    drafted: Mapped[int] = mapped_column(Integer)  # draft tokens over all steps
    accepted: Mapped[int] = mapped_column(Integer)
    payload: Mapped[bytes] = mapped_column(LargeBinary)  # online.stream.events.encode_trace bytes


class DrafterVersion(Base):
    """Each (target model, drafter version) pair seen in the traffic, with its trace count."""

    __tablename__ = "drafter_versions"

    target_model: Mapped[str] = mapped_column(String(256), primary_key=True)
    version: Mapped[str] = mapped_column(String(256), primary_key=True)
    first_seen_at: Mapped[float] = mapped_column(Float)
    last_seen_at: Mapped[float] = mapped_column(Float)
    traces: Mapped[int] = mapped_column(BigInteger)


class DeadLetter(Base):
    """A record no reader could decode, kept verbatim with the reason.

    (source, partition, offset) is unique so a redelivered bad record is stored once;
    rows without an offset (NULLs are distinct) are always kept.
    """

    __tablename__ = "dead_letters"
    __table_args__ = (UniqueConstraint("source", "partition", "offset", name="uq_dead_letters_position"),)

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    at: Mapped[float] = mapped_column(Float)
    reason: Mapped[str] = mapped_column(Text)
    source: Mapped[str] = mapped_column(String(256))
    partition: Mapped[int | None] = mapped_column(Integer)
    offset: Mapped[int | None] = mapped_column(BigInteger)
    payload: Mapped[bytes] = mapped_column(LargeBinary)


class ConsumerOffset(Base):
    """The next offset a consumer group reads from a partition of the embedded stream."""

    __tablename__ = "consumer_offsets"

    consumer_group: Mapped[str] = mapped_column(String(256), primary_key=True)
    partition: Mapped[int] = mapped_column(Integer, primary_key=True)
    next_offset: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[float] = mapped_column(Float)


class StreamEvent(Base):
    """The embedded stream's append-only log; `id` is the record offset (one partition, 0)."""

    __tablename__ = "stream_events"
    __table_args__ = ({"sqlite_autoincrement": True},)

    id: Mapped[int] = mapped_column(Id, primary_key=True, autoincrement=True)
    key: Mapped[str | None] = mapped_column(Text)
    payload: Mapped[bytes] = mapped_column(LargeBinary)
    at: Mapped[float] = mapped_column(Float)
