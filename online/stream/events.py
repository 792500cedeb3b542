"""RequestTrace on the wire: a versioned msgpack (or JSON) object, one per request.

The object form is shared by both encodings (JSONL export uses it too):

    {"schema_version": 1, "event_id": str, "request_id": str, "trace_id": str,
     "target_model": str, "drafter_version": str,
     "prompt_ids": [int], "output_ids": [int],
     "sources": [str],                        # the distinct step sources of this trace
     "steps": [[pos, [drafted], source_index, accepted]              # all accepted
               | [pos, [drafted], source_index, accepted, [topk_ids], [topk_logprobs]]],
     "temperature": float, "top_p": float, "seed": int | None, "max_new_tokens": int,
     "finish_reason": str, "tag": str | None,
     "timings": {"prefill_s": float, "draft_s": float, "verify_s": float, "total_s": float},
     "created_at": float, "finished_at": float,
     # optional, from an engine without per-step records (llama-server):
     "counts": [steps, drafted, accepted],
     "topk": [[[topk_ids], [topk_logprobs]] per output position]}

Steps are positional arrays because a trace has dozens of them. Adding an optional
key keeps the schema version (readers ignore keys they do not know); any other
change bumps `runtime.trace.SCHEMA_VERSION` and adds a decoder to `_DECODERS`.
`event_id` is stable across retries and redeliveries: consumers de-duplicate on it.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Callable
from typing import Any

import msgpack

from runtime.errors import LivedraftError
from runtime.trace import SCHEMA_VERSION, DraftCounts, RequestTrace, StepRecord, Timings


class EventDecodeError(LivedraftError, ValueError):
    """A payload that is not a RequestTrace this reader understands.

    `reason` says what was wrong; consumers dead-letter the record with it and go on.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def trace_to_obj(trace: RequestTrace) -> dict[str, Any]:
    """The wire object (plain dicts, lists and scalars) of `trace`; see the module docstring."""
    sources: dict[str, int] = {}
    steps = []
    for s in trace.steps:
        si = sources.setdefault(s.source, len(sources))
        if s.topk_ids is None:
            steps.append([s.pos, s.drafted, si, s.accepted])
        else:
            steps.append([s.pos, s.drafted, si, s.accepted, s.topk_ids, s.topk_logprobs])
    t = trace.timings
    obj = {
        "schema_version": trace.schema_version, "event_id": trace.event_id,
        "request_id": trace.request_id, "trace_id": trace.trace_id,
        "target_model": trace.target_model, "drafter_version": trace.drafter_version,
        "prompt_ids": trace.prompt_ids, "output_ids": trace.output_ids,
        "sources": list(sources), "steps": steps,
        "temperature": trace.temperature, "top_p": trace.top_p, "seed": trace.seed,
        "max_new_tokens": trace.max_new_tokens, "finish_reason": trace.finish_reason,
        "tag": trace.tag,
        "timings": {"prefill_s": t.prefill_s, "draft_s": t.draft_s, "verify_s": t.verify_s, "total_s": t.total_s},
        "created_at": trace.created_at, "finished_at": trace.finished_at,
    }
    if trace.counts is not None:
        obj["counts"] = [trace.counts.steps, trace.counts.drafted, trace.counts.accepted]
    if trace.position_topk is not None:
        obj["topk"] = [[ids, lps] for ids, lps in trace.position_topk]
    return obj


def trace_from_obj(obj: Any) -> RequestTrace:
    """Inverse of `trace_to_obj`. Raises EventDecodeError on anything malformed or too new."""
    if not isinstance(obj, dict):
        raise EventDecodeError(f"a trace must be a map, got {type(obj).__name__}")
    version = obj.get("schema_version")
    if type(version) is not int or version < 1:
        raise EventDecodeError(f"schema_version must be a positive int, got {version!r}")
    decoder = _DECODERS.get(version)
    if decoder is None:
        raise EventDecodeError(
            f"schema_version {version} is newer than this reader supports ({SCHEMA_VERSION}): "
            "upgrade livedraft where the events are consumed"
        )
    try:
        return decoder(obj)
    except EventDecodeError:
        raise
    except (KeyError, TypeError, ValueError, OverflowError, IndexError) as e:
        raise EventDecodeError(f"malformed v{version} trace: {type(e).__name__}: {e}") from None


def encode_trace(trace: RequestTrace) -> bytes:
    """msgpack bytes of `trace` (the form every stream transport carries)."""
    return msgpack.packb(trace_to_obj(trace), use_bin_type=True)


def decode_trace(payload: bytes) -> RequestTrace:
    """Parses `encode_trace` output. Raises EventDecodeError (never anything else) when
    the bytes are not msgpack, not a trace, or of a newer schema version."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise EventDecodeError(f"not a msgpack payload ({len(payload)} bytes): {type(e).__name__}: {e}") from None
    return trace_from_obj(obj)


def trace_to_json(trace: RequestTrace) -> str:
    """One JSON line (no newline) of `trace`; floats round-trip exactly."""
    return json.dumps(trace_to_obj(trace), separators=(",", ":"))


def trace_from_json(line: str) -> RequestTrace:
    """Parses `trace_to_json` output. Raises EventDecodeError on bad JSON or a bad trace."""
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise EventDecodeError(f"not a JSON object: {e}") from None
    return trace_from_obj(obj)


def _decode_v1(o: dict[str, Any]) -> RequestTrace:
    sources = o["sources"]
    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        raise EventDecodeError(f"sources must be a list of strings, got {sources!r}")
    t = o["timings"]
    return RequestTrace(
        request_id=_str(o, "request_id"),
        prompt_ids=_ints(o["prompt_ids"], "prompt_ids"),
        output_ids=_ints(o["output_ids"], "output_ids"),
        steps=_steps_v1(o["steps"], sources),
        target_model=_str(o, "target_model"),
        drafter_version=_str(o, "drafter_version"),
        temperature=_float(o["temperature"], "temperature"),
        top_p=_float(o["top_p"], "top_p"),
        seed=_opt_int(o["seed"], "seed"),
        max_new_tokens=_int(o["max_new_tokens"], "max_new_tokens"),
        finish_reason=_str(o, "finish_reason"),
        tag=None if o["tag"] is None else _str(o, "tag"),
        timings=Timings(*(_float(t[k], k) for k in ("prefill_s", "draft_s", "verify_s", "total_s"))),
        created_at=_float(o["created_at"], "created_at"),
        finished_at=_float(o["finished_at"], "finished_at"),
        trace_id=_str(o, "trace_id"),
        event_id=_str(o, "event_id"),
        schema_version=1,
        counts=_counts(o.get("counts")),
        position_topk=_position_topk(o.get("topk")),
    )


def _counts(v: Any) -> DraftCounts | None:
    if v is None:
        return None
    if type(v) is not list or len(v) != 3 or not all(type(x) is int and x >= 0 for x in v):
        raise EventDecodeError(f"counts must be [steps, drafted, accepted] (ints >= 0), got {v!r:.80}")
    return DraftCounts(*v)


def _position_topk(v: Any) -> list[tuple[list[int], list[float]]] | None:
    if v is None:
        return None
    out = []
    for item in _list(v, "topk"):
        if type(item) is not list or len(item) != 2 or type(item[0]) is not list or type(item[1]) is not list \
                or len(item[0]) != len(item[1]):
            raise EventDecodeError(f"a topk entry must be [[ids], [logprobs]] of one length, got {item!r:.80}")
        array("i", item[0])
        out.append((item[0], array("d", item[1]).tolist()))
    return out


def _steps_v1(raw: Any, sources: list[str]) -> list[StepRecord]:
    # The hot loop of every consumer (a trace has dozens of steps): checks are inlined
    # and token lists are validated by array() at C speed; only topk logprobs are copied
    # (msgpack may give ints where floats were meant).
    n_src = len(sources)
    steps = []
    append = steps.append
    for s in _list(raw, "steps"):
        if type(s) is not list:
            raise EventDecodeError(f"a step must be an array, got {s!r:.80}")
        n = len(s)
        if n == 4:
            pos, drafted, si, accepted = s
            ids = lps = None
        elif n == 6:
            pos, drafted, si, accepted, ids, lps = s
            if type(ids) is not list or type(lps) is not list or len(ids) != len(lps):
                raise EventDecodeError(f"topk_ids and topk_logprobs must be arrays of one length, got {s[4:]!r:.80}")
            array("i", ids)
            lps = array("d", lps).tolist()
        else:
            raise EventDecodeError(f"a step must be a 4- or 6-element array, got {s!r:.80}")
        if type(pos) is not int or type(accepted) is not int:
            raise EventDecodeError(f"step pos and accepted must be ints, got {pos!r:.20} and {accepted!r:.20}")
        if type(si) is not int or not 0 <= si < n_src:
            raise EventDecodeError(f"step source index {si!r} is not an index into sources {sources}")
        if type(drafted) is not list:
            raise EventDecodeError(f"drafted must be an array, got {type(drafted).__name__}")
        array("i", drafted)
        append(StepRecord(pos, drafted, sources[si], accepted, ids, lps))
    return steps


def _list(v: Any, name: str) -> list:
    if not isinstance(v, list):
        raise EventDecodeError(f"{name} must be an array, got {type(v).__name__}")
    return v


def _ints(v: Any, name: str) -> list[int]:
    array("i", _list(v, name))  # C-speed check: TypeError/OverflowError unless every item fits int32
    return v


def _int(v: Any, name: str) -> int:
    if type(v) is not int:
        raise EventDecodeError(f"{name} must be an int, got {v!r:.40}")
    return v


def _opt_int(v: Any, name: str) -> int | None:
    return None if v is None else _int(v, name)


def _float(v: Any, name: str) -> float:
    if type(v) not in (float, int):
        raise EventDecodeError(f"{name} must be a number, got {v!r:.40}")
    return float(v)


def _str(o: dict[str, Any], name: str) -> str:
    v = o[name]
    if not isinstance(v, str):
        raise EventDecodeError(f"{name} must be a string, got {v!r:.40}")
    return v


_DECODERS: dict[int, Callable[[dict[str, Any]], RequestTrace]] = {1: _decode_v1}
