"""JSON Lines export/import of traces: one `online.stream.events.trace_to_json` object per line.

Import is strict: a line that is not a valid trace raises `JsonlError` naming the file
and line, rather than silently dropping training data (blank lines are skipped). Fix
or cut the line and import again; the store skips traces already imported (event_id).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from online.stream.events import EventDecodeError, trace_from_json, trace_to_json
from runtime.errors import LivedraftError
from runtime.trace import RequestTrace


class JsonlError(LivedraftError, ValueError):
    """A JSONL file that cannot be read as traces; the message has file:line and the reason."""


def export_jsonl(traces: Iterable[RequestTrace], path: str | os.PathLike) -> int:
    """Writes `traces` to `path` (atomically: a temp file renamed into place); returns the count."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    n = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for t in traces:
                f.write(trace_to_json(t))
                f.write("\n")
                n += 1
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return n


def import_jsonl(path: str | os.PathLike) -> Iterator[RequestTrace]:
    """Yields the traces in `path` in file order. Raises JsonlError on a missing file or a
    bad line (after yielding the good lines before it)."""
    p = Path(path)
    if not p.is_file():
        raise JsonlError(f"{p} does not exist or is not a file")
    with p.open(encoding="utf-8") as f:
        n = 0
        try:
            for n, line in enumerate(f, 1):  # noqa: B007 (n is used in the error message)
                if line.strip():
                    yield trace_from_json(line)
        except EventDecodeError as e:
            raise JsonlError(f"{p}:{n}: not a trace: {e.reason}") from None
        except UnicodeDecodeError as e:
            raise JsonlError(f"{p}:{n + 1}: not UTF-8 text: {e}") from None
