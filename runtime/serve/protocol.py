"""The OpenAI completions protocol as livedraft serves it: a typed request model validated before
anything is queued, and the response bodies.

Every field is checked for type and range, and everything the trace store must hold is refused
here with a 400, so an answered request never loses its trace later (a tag longer than the
store's column, a NUL the database rejects, a seed outside its 64-bit column). OpenAI fields this
server cannot honour answer 400 naming the field; unknown fields are ignored (clients send
`model`, `user`, ...). Temperatures below 1e-5 decode greedily (the limit the sampler tends to;
vLLM's rule), so a tiny positive temperature never divides logits into infinities.
"""

from __future__ import annotations

import math
import re
import unicodedata
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
)

from runtime.engine import STOP_STRING, GenerationResult, SamplingParams
from runtime.errors import RequestError

MAX_TAG_CHARS = 256  # the trace store's tag column
MAX_SEED = 2**63 - 1  # the trace store's seed column (signed 64-bit)
MAX_STOP = 4
GREEDY_BELOW = 1e-5  # temperature under this decodes greedily
MAX_TEMPERATURE = 100.0
MAX_JSON_DEPTH = 64

# OpenAI completions options this server does not implement: a request that sets one to anything
# but its neutral value is refused with the field's name, never silently ignored.
UNSUPPORTED = {
    "n": lambda v: v == 1 and type(v) is int,
    "best_of": lambda v: v == 1 and type(v) is int,
    "echo": lambda v: v is False,
    "logprobs": lambda v: v is None or v is False,
    "suffix": lambda v: v is None,
    "logit_bias": lambda v: v is None or v == {},
    "presence_penalty": lambda v: v is None or (type(v) in (int, float) and v == 0),
    "frequency_penalty": lambda v: v is None or (type(v) in (int, float) and v == 0),
}


class Metadata(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tag: str | None = None


class CompletionBody(BaseModel):
    """POST /v1/completions."""

    model_config = ConfigDict(extra="ignore")

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    stream: StrictBool = False
    user: str | None = None
    metadata: Metadata | None = None
    speculate: StrictBool = True  # livedraft: False serves the request with the target alone

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _number(cls, v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError("must be a number")
        if not math.isfinite(v):
            raise ValueError("must be finite")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [] if v is None else [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP or not all(stops):
            raise ValueError(f"must be a non-empty string or a list of up to {MAX_STOP} non-empty strings")
        for s in stops:
            try:
                check_text(s, "stop")
            except ValueError:  # _first_error prefixes the field's name
                raise ValueError("must be valid Unicode (a stop string holds a lone surrogate)") from None
        return stops


def check_text(s: str, field: str) -> None:
    """Raises ValueError for text that is not valid Unicode (a lone surrogate from JSON's \\ud800)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{field} is not valid Unicode (it holds a lone surrogate)") from None


def check_tag(tag: str | None) -> str | None:
    """The trace tag, refused when the store cannot hold it. Raises RequestError."""
    if tag is None:
        return None
    if not isinstance(tag, str):
        raise RequestError(f"the tag must be a string, got {tag!r:.40}")
    if not tag or len(tag) > MAX_TAG_CHARS:
        raise RequestError(f"the tag must be 1 to {MAX_TAG_CHARS} characters, got {len(tag)}")
    if any(unicodedata.category(c) == "Cc" for c in tag):  # C0, DEL and C1 (U+0080-U+009F)
        raise RequestError("the tag must not contain control characters (NUL, newline, U+0085, ...)")
    try:
        check_text(tag, "the tag")
    except ValueError as e:
        raise RequestError(str(e)) from None
    return tag


def json_depth_ok(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """False when brackets nest deeper than `limit` (outside strings): checked before parsing,
    so a hostile body cannot exhaust the parser's recursion."""
    depth, in_str, esc = 0, False, False
    for b in raw:
        if in_str:
            if esc:
                esc = False
            elif b == 0x5C:  # backslash
                esc = True
            elif b == 0x22:
                in_str = False
        elif b == 0x22:
            in_str = True
        elif b in (0x5B, 0x7B):
            depth += 1
            if depth > limit:
                return False
        elif b in (0x5D, 0x7D):
            depth -= 1
    return True


def parse_completion(obj: Any, *, encode: Any, default_max_tokens: int = 64):  # noqa: ANN201 - CompletionRequest
    """Validates a decoded JSON body into a CompletionRequest (runtime/serve/worker.py). `encode(text)`
    tokenizes a text prompt (None: the model has no tokenizer). Raises RequestError naming the field."""
    from runtime.serve.worker import CompletionRequest

    if not isinstance(obj, dict):
        raise RequestError("the request body must be a JSON object")
    for name, neutral in UNSUPPORTED.items():
        if name in obj and not neutral(obj[name]):
            raise RequestError(f"{name}={obj[name]!r:.60} is not supported by this server: leave {name} out")
    try:
        body = CompletionBody.model_validate(obj)
    except ValidationError as e:
        raise RequestError(_first_error(e)) from None
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        raise RequestError("prompt: one prompt per request (a string or a list of token ids)")
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt is empty: give some text or a list of token ids")
        try:
            check_text(prompt, "prompt")
        except ValueError as e:
            raise RequestError(str(e)) from None
        if encode is None:
            raise RequestError("this model has no tokenizer: send the prompt as a list of token ids")
        prompt_ids = list(encode(prompt))
    else:
        prompt_ids = list(prompt)
    if not prompt_ids:
        raise RequestError("prompt is empty: give at least one token")
    temperature = body.temperature if body.temperature >= GREEDY_BELOW else 0.0
    params = SamplingParams(max_new_tokens=body.max_tokens or default_max_tokens, temperature=temperature,
                            top_p=body.top_p, seed=body.seed)
    params.validate()
    tag = body.metadata.tag if body.metadata is not None and body.metadata.tag is not None else body.user
    return CompletionRequest(prompt_ids, params, body.stream, body.stop, check_tag(tag), body.speculate)


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|function-.*)$")


def _first_error(e: ValidationError) -> str:
    """One message naming the field, in the server's own words."""
    err = e.errors()[0]
    field = ".".join(str(x) for x in err["loc"] if isinstance(x, str) and not _TYPE_TAG.match(x)) or "body"
    t, ctx, got = err["type"], err.get("ctx") or {}, f", got {err.get('input')!r:.40}"
    if t == "missing":
        return f"missing field {field!r}" + (" (a string or a list of token ids)" if field == "prompt" else "")
    if field == "prompt":
        return "prompt must be a string or a list of integer token ids (one prompt per request)" + got
    if t in ("int_type", "int_parsing", "int_from_float"):
        return f"{field} must be an integer{got}"
    if t in ("bool_type", "bool_parsing"):
        return f"{field} must be true or false{got}"
    if t in ("string_type", "model_type", "model_attributes_type", "dict_type"):
        return f"{field} must be {'a JSON object' if t != 'string_type' else 'a string'}{got}"
    for key, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if key in ctx:
            return f"{field} must be {op} {ctx[key]}{got}"
    return f"{field} {err['msg'].removeprefix('Value error, ')}"


def finish_reason(stopped: bool, res: GenerationResult) -> str:
    """OpenAI's finish_reason: "stop" for EOS and for stop strings, else "length"."""
    return "stop" if stopped or res.finish_reason == STOP_STRING else res.finish_reason


def usage(res: GenerationResult) -> dict[str, int]:
    p, c = len(res.prompt_ids), len(res.output_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def livedraft_info(res: GenerationResult) -> dict[str, Any]:
    return {"drafter_version": res.trace.drafter_version, "output_ids": res.output_ids,
            "stats": res.stats.to_dict()}


def error_body(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind}}
