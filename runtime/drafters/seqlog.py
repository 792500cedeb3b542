"""The bounded FIFO of token sequences a model-free cache holds, and its snapshot codec.

Both the suffix cache and the n-gram table are materialised views of the same thing: the
last N finished sequences (per tag). They keep those sequences here, evict the oldest whole
sequence when a bound is passed, and snapshot them as the list of live sequences in FIFO
order. Restoring re-adds that list, so a restored cache equals one that saw the full stream.
"""

from __future__ import annotations

import json
import struct
import threading
import zlib
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Self

import numpy as np

from runtime.errors import LivedraftError

MAX_TOKEN_ID = (1 << 21) - 1  # 2M ids: above every tokenizer in use; n-gram keys pack 21 bits per token

_MAGIC = b"LDSEQ"
_FORMAT_VERSION = 1
_HEAD = struct.Struct("<5sBII")  # magic, format version, header length, crc32 of the rest


class SnapshotError(LivedraftError, ValueError):
    """Bytes that are not a readable cache snapshot (foreign, corrupt, newer format, wrong kind)."""

# One shared int object per token id, so cached tuples hold 8-byte pointers instead of
# 28-byte ints each (tokens decoded from JSON/msgpack are distinct objects). Grows only.
_INTS: list[int] = list(range(1 << 16))


def intern_tokens(tokens: Iterable[int]) -> tuple[int, ...]:
    """`tokens` as a tuple of shared int objects; ValueError outside [0, MAX_TOKEN_ID]."""
    toks = tokens if isinstance(tokens, (list, tuple)) else list(tokens)
    if not toks:
        return ()
    lo, hi = min(toks), max(toks)
    if lo < 0 or hi > MAX_TOKEN_ID:
        raise ValueError(f"token ids must lie in [0, {MAX_TOKEN_ID}], got min {lo}, max {hi}")
    if hi >= len(_INTS):
        _INTS.extend(range(len(_INTS), hi + 1))
    return tuple(map(_INTS.__getitem__, toks))


@dataclass(frozen=True)
class LoggedSequence:
    """One cached sequence; `handle` is the owning structure's id for it (or -1)."""

    tokens: tuple[int, ...]
    tag: str | None = None
    handle: int = -1


class SequenceLog:
    """FIFO of sequences bounded by count and, optionally, by total tokens.

    `push` returns the sequences it evicted, oldest first; the caller removes them from
    its index. A sequence longer than `max_tokens` is truncated to its first `max_tokens`.
    """

    def __init__(self, max_sequences: int, max_tokens: int | None = None) -> None:
        if max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {max_sequences}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}")
        self.max_sequences, self.max_tokens = max_sequences, max_tokens
        self._fifo: deque[LoggedSequence] = deque()
        self.num_tokens = 0

    def clip(self, tokens: tuple[int, ...]) -> tuple[int, ...]:
        """`tokens` cut to what one sequence may hold."""
        return tokens if self.max_tokens is None else tokens[: self.max_tokens]

    def push(self, seq: LoggedSequence) -> list[LoggedSequence]:
        self._fifo.append(seq)
        self.num_tokens += len(seq.tokens)
        evicted = []
        while len(self._fifo) > self.max_sequences or (
            self.max_tokens is not None and self.num_tokens > self.max_tokens
        ):
            old = self._fifo.popleft()
            self.num_tokens -= len(old.tokens)
            evicted.append(old)
        return evicted

    def __len__(self) -> int:
        return len(self._fifo)

    def __iter__(self) -> Iterator[LoggedSequence]:
        return iter(self._fifo)


@dataclass
class Snapshot:
    kind: str
    config: dict
    stream_offsets: dict[int, int]  # partition -> next offset to read: what the snapshot includes
    sequences: list[LoggedSequence]


def encode_snapshot(
    kind: str, config: dict, stream_offsets: dict[int, int], sequences: Sequence[LoggedSequence]
) -> bytes:
    """Versioned bytes: a JSON header (kind, config, stream offsets, tags) and zlib-packed tokens."""
    tags = sorted({s.tag for s in sequences if s.tag is not None})
    tag_ix = {t: i for i, t in enumerate(tags)}
    lengths = np.fromiter((len(s.tokens) for s in sequences), np.uint32, len(sequences))
    tag_col = np.fromiter((tag_ix.get(s.tag, -1) for s in sequences), np.int32, len(sequences))
    total = int(lengths.sum())
    hi = max((max(s.tokens) for s in sequences if s.tokens), default=0)
    dtype = np.uint16 if hi <= 0xFFFF else np.uint32
    flat = np.fromiter((t for s in sequences for t in s.tokens), dtype, total)
    header = json.dumps({
        "kind": kind, "config": config, "stream_offsets": {str(p): int(o) for p, o in stream_offsets.items()},
        "count": len(sequences), "tags": tags, "token_bytes": flat.itemsize,
    }).encode()
    rest = header + zlib.compress(lengths.tobytes() + tag_col.tobytes() + flat.tobytes(), 1)
    return _HEAD.pack(_MAGIC, _FORMAT_VERSION, len(header), zlib.crc32(rest)) + rest


def decode_snapshot(data: bytes, kind: str) -> Snapshot:
    """Inverse of encode_snapshot; SnapshotError on foreign or corrupt bytes, a newer format
    version or another kind of cache."""
    if len(data) < _HEAD.size:
        raise SnapshotError("not a livedraft cache snapshot: too short")
    magic, version, hlen, crc = _HEAD.unpack_from(data)
    if magic != _MAGIC:
        raise SnapshotError("not a livedraft cache snapshot: bad magic bytes")
    if version != _FORMAT_VERSION:
        raise SnapshotError(
            f"snapshot format {version} is not supported (this build reads format {_FORMAT_VERSION}): "
            "upgrade livedraft or delete the snapshot to rebuild the cache from the stream"
        )
    if zlib.crc32(data[_HEAD.size:]) != crc:
        raise SnapshotError("snapshot is corrupt: checksum mismatch (truncated or overwritten file)")
    try:
        header = json.loads(data[_HEAD.size:_HEAD.size + hlen])
        if header["kind"] != kind:
            raise SnapshotError(f"snapshot holds a {header['kind']!r} cache, expected {kind!r}")
        n, tags = header["count"], header["tags"]
        body = zlib.decompress(data[_HEAD.size + hlen:])
        lengths = np.frombuffer(body, np.uint32, n, 0)
        tag_col = np.frombuffer(body, np.int32, n, 4 * n)
        dtype = np.uint16 if header["token_bytes"] == 2 else np.uint32
        flat = np.frombuffer(body, dtype, offset=8 * n).tolist()
        offsets = {int(p): int(o) for p, o in header["stream_offsets"].items()}
    except (ValueError, KeyError, TypeError, zlib.error) as e:
        if isinstance(e, SnapshotError):
            raise
        raise SnapshotError(f"snapshot is corrupt: {e}") from e
    if int(lengths.sum()) != len(flat):
        raise SnapshotError("snapshot is corrupt: token count does not match the sequence lengths")
    seqs, start = [], 0
    for length, t in zip(lengths.tolist(), tag_col.tolist(), strict=True):
        toks = intern_tokens(flat[start:start + length])
        seqs.append(LoggedSequence(toks, tags[t] if t >= 0 else None))
        start += length
    return Snapshot(kind, header["config"], offsets, seqs)


class SnapshotMixin:
    """The bounded sequence log of a model-free cache (SuffixCache, NGramTable): adding,
    write-through, eviction, snapshot/restore.

    The host class has `SNAPSHOT_KIND`, `CONFIG` (its config dataclass, with `max_sequences`,
    `max_tokens`, `tag_scoped` and `include_prompt`), `_insert(tokens, tag) -> handle` and
    `_remove(seq)` over its own index, and calls `_init_sequences(config)` from `__init__`.

    The log is a materialised view of the traffic stream: sequences in stream order, so two
    replicas fed the same stream hold the same log (and snapshots). A serving replica also
    *writes through* (SuffixDecoding as published): a request's output enters the index the
    moment the request ends, as a pending entry keyed by its request id; when the stream
    later delivers that request's trace, `confirm` moves the entry into the log at its stream
    position without counting it again. Pending entries are never snapshotted, and are
    bounded by `max_sequences` on their own (the oldest is dropped from the index).
    A snapshot is the log in FIFO order: restoring replays it, so the rebuilt structure
    (counts, eviction order) equals the one snapshotted.
    """

    SNAPSHOT_KIND: ClassVar[str]
    CONFIG: ClassVar[type]
    config: Any
    stream_offsets: dict[int, int]

    @property
    def ready(self) -> bool:
        """Whether a restored snapshot can serve as is (a VocabBridge also needs its tokenizers,
        which a snapshot does not hold: the maintainer re-adds its sequences into one that has them)."""
        return True

    def _init_sequences(self, config: Any) -> None:
        self.config = config
        # The caller's stream position (partition -> next offset) that the contents include.
        self.stream_offsets = {}
        self._log = SequenceLog(config.max_sequences, config.max_tokens)
        self._pending: OrderedDict[str, LoggedSequence] = OrderedDict()  # write-through, not yet on the stream
        self._lock = threading.Lock()  # every read and every chunk of a write
        self._write_lock = threading.Lock()  # one whole write (insert with its evictions) at a time

    def _insert(self, tokens: tuple[int, ...], tag: str | None) -> int:
        raise NotImplementedError

    def _remove(self, seq: LoggedSequence) -> None:
        raise NotImplementedError

    def _key(self, tag: str | None) -> str | None:
        """The global structure a tag reads and writes (one per tag when `tag_scoped`)."""
        return tag if self.config.tag_scoped else None

    def cached_tokens(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> list[int]:
        """What the cache keeps of a finished request: its output, or prompt + output with
        config.include_prompt (one rule for the stream and for write-through)."""
        return [*prompt_ids, *output_ids] if self.config.include_prompt else list(output_ids)

    def add_sequence(self, tokens: Sequence[int], tag: str | None = None) -> None:
        """Caches a finished sequence from the stream, evicting the oldest past the bounds."""
        toks = self._log.clip(intern_tokens(tokens))
        if not toks:
            return
        with self._write_lock:
            handle = self._insert(toks, tag)
            with self._lock:
                evicted = self._log.push(LoggedSequence(toks, tag, handle))
            for old in evicted:
                self._remove(old)

    def write_through(self, key: str, tokens: Sequence[int], tag: str | None = None) -> None:
        """Caches the output of request `key`, which this replica just served, ahead of its
        trace on the stream (`confirm` later puts it in stream order)."""
        toks = self._log.clip(intern_tokens(tokens))
        if not toks:
            return
        with self._write_lock:
            handle = self._insert(toks, tag)
            with self._lock:
                dropped = [self._pending.pop(key)] if key in self._pending else []
                self._pending[key] = LoggedSequence(toks, tag, handle)
                while len(self._pending) > self._log.max_sequences:
                    dropped.append(self._pending.popitem(last=False)[1])
            for old in dropped:
                self._remove(old)

    def confirm(self, key: str, tokens: Sequence[int], tag: str | None = None) -> bool:
        """The stream delivered the trace of request `key`. True when it was written through
        with the same tokens and tag: it joins the log here, counted once. False otherwise
        (the caller adds it; a stale pending entry with other contents is dropped)."""
        with self._write_lock:
            with self._lock:
                seq = self._pending.pop(key, None)
            if seq is None:
                return False
            if seq.tokens != self._log.clip(intern_tokens(tokens)) or seq.tag != tag:
                self._remove(seq)
                return False
            with self._lock:
                evicted = self._log.push(seq)
            for old in evicted:
                self._remove(old)
            return True

    @property
    def num_pending(self) -> int:
        """Written-through sequences whose trace the stream has not delivered yet."""
        return len(self._pending)

    @property
    def num_sequences(self) -> int:
        return len(self._log)

    @property
    def num_tokens(self) -> int:
        return self._log.num_tokens

    def sequences(self) -> list[LoggedSequence]:
        """The cached sequences, oldest first (a copy)."""
        with self._lock:
            return list(self._log)

    def snapshot(self) -> bytes:
        """The cached sequences (FIFO order), config and stream_offsets as versioned bytes."""
        with self._lock:
            seqs, offsets = list(self._log), dict(self.stream_offsets)
        return encode_snapshot(self.SNAPSHOT_KIND, asdict(self.config), offsets, seqs)

    @classmethod
    def restore(cls, data: bytes) -> Self:
        """A cache equal to the one snapshotted (same config, sequences, stream_offsets).
        Raises SnapshotError on foreign, corrupt or newer-format bytes or an unusable config."""
        snap = decode_snapshot(data, cls.SNAPSHOT_KIND)
        try:
            cache = cls(cls.CONFIG(**snap.config))
        except (TypeError, ValueError) as e:
            raise SnapshotError(f"snapshot holds an unusable config {snap.config}: {e}") from e
        for seq in snap.sequences:
            cache.add_sequence(seq.tokens, seq.tag)
        cache.stream_offsets = dict(snap.stream_offsets)
        return cache
