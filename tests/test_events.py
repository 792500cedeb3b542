"""The RequestTrace wire format: exact round trips, and EventDecodeError (never anything
else) for malformed payloads and newer schema versions."""

from __future__ import annotations

import json
import random

import msgpack
import pytest

from devkit.synthetic import synthetic_trace
from online.stream.events import (
    EventDecodeError,
    decode_trace,
    encode_trace,
    trace_from_json,
    trace_from_obj,
    trace_to_json,
    trace_to_obj,
)
from runtime.trace import SCHEMA_VERSION, RequestTrace, StepRecord


def sample(seed=0):
    t = synthetic_trace(random.Random(seed), prompt_len=6, output_len=20, tag="docs")
    t.steps.append(StepRecord(20, [7], "suffix", 0, [1, 2], [-0.1, -2.5]))  # a second source
    t.seed, t.temperature, t.top_p = 1234, 0.7, 0.9
    return t


def test_msgpack_and_json_round_trip_exactly():
    t = sample()
    assert decode_trace(encode_trace(t)) == t
    assert trace_from_json(trace_to_json(t)) == t
    empty = RequestTrace("r", [], [], [], "m", "d", seed=None, tag=None)
    assert decode_trace(encode_trace(empty)) == empty
    assert trace_to_obj(t)["sources"] == ["model", "suffix"]


def test_unknown_optional_keys_are_ignored():
    obj = trace_to_obj(sample())
    obj["added_later"] = {"x": 1}
    assert trace_from_obj(obj) == sample()


def test_newer_schema_version_is_a_decode_error_with_a_reason():
    obj = trace_to_obj(sample())
    obj["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(EventDecodeError, match="newer than this reader") as e:
        decode_trace(msgpack.packb(obj))
    assert "upgrade" in e.value.reason
    with pytest.raises(EventDecodeError):
        trace_from_json(json.dumps(obj))


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", b"\x92\x01", b"not msgpack at all", msgpack.packb(None), msgpack.packb([1, 2]),
    msgpack.packb({"schema_version": "1"}), msgpack.packb({"schema_version": 0}), msgpack.packb({1: 2}),
    msgpack.packb({"schema_version": 1}),
])
def test_malformed_payloads_raise_decode_error(payload):
    with pytest.raises(EventDecodeError) as e:
        decode_trace(payload)
    assert e.value.reason


@pytest.mark.parametrize("field,value", [
    ("prompt_ids", [1, "2"]), ("prompt_ids", [2**40]), ("output_ids", None), ("steps", [[0, [1], 0]]),
    ("steps", [[0, [1], 5, 1]]), ("steps", [[0, [1], 0, 1, [1, 2], [-0.1]]]), ("sources", [1]),
    ("temperature", "hot"), ("seed", 1.5), ("tag", 3), ("timings", {"prefill_s": 0}), ("event_id", None),
    ("created_at", [1]),
])
def test_wrong_field_types_raise_decode_error(field, value):
    obj = trace_to_obj(sample())
    obj[field] = value
    with pytest.raises(EventDecodeError):
        decode_trace(msgpack.packb(obj))


def test_random_corruption_never_raises_anything_else():
    rng = random.Random(0)
    good = encode_trace(sample())
    for i in range(2000):
        b = bytearray(good)
        if i % 3 == 0:
            b = b[:rng.randrange(len(b))]  # truncated
        else:
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        try:
            t = decode_trace(bytes(b))
        except EventDecodeError:
            continue
        assert isinstance(t, RequestTrace)  # a flip that still decodes must still be a trace
    for line in ("", "{", "[]", "null", '{"schema_version": 1, "steps": []}', "\ud800"):
        with pytest.raises(EventDecodeError):
            trace_from_json(line)
