"""The HTTP API in front of one engine: OpenAI-compatible completions, health, metrics, drafter status.

Threads: the stdlib ThreadingHTTPServer parses each request in its own thread
and queues it in a FairQueue (per client, round-robin); one worker thread runs
the engine, which is not thread-safe, one request at a time. Streamed tokens
go back to the request's thread through a per-request queue, which decodes
text and writes server-sent events, so the engine never waits on a socket.

Routes: POST /v1/completions, GET /healthz, GET /metrics, GET /v1/drafter,
GET /v1/models. Errors are JSON `{"error": {"message", "type"}}` with a 4xx
for anything the client can fix; no request can take the server down.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from runtime.engine import STOP_STRING, GenerationResult, SamplingParams, SpeculativeEngine
from runtime.errors import RequestError
from runtime.fairqueue import FairQueue, QueueFull
from runtime.hotswap import HotSwapper
from runtime.metrics import CONTENT_TYPE, ServerMetrics

log = logging.getLogger(__name__)

_DONE = object()  # end of a job's token stream


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port
    max_queue: int = 64  # requests waiting, all clients; beyond it: 503
    max_queue_per_client: int = 16  # requests waiting per client; beyond it: 429
    max_body_bytes: int = 1 << 20
    default_max_tokens: int = 64
    request_timeout_s: float = 300.0  # a request not finished by then gets a 504 (and is cancelled)


@dataclass
class CompletionRequest:
    """A validated POST /v1/completions body."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    stop: list[str] = field(default_factory=list)
    tag: str | None = None


class _Cancelled(Exception):
    """Raised from the token callback to abandon a request whose client went away."""


@dataclass
class _Job:
    req: CompletionRequest
    client: str
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: float = field(default_factory=time.time)
    queued_at: float = field(default_factory=time.perf_counter)
    # (token ids, their text or None), then _DONE; the text is there when the worker decoded it
    chunks: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    text: TextStream | None = None  # the completion's text, decoded by one thread at a time
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    result: GenerationResult | None = None
    error: tuple[int, str, str] | None = None  # (status, type, message)


def parse_completion(body: Any, *, tokenizer: Any, default_max_tokens: int = 64) -> CompletionRequest:
    """Validates an OpenAI completions body. Raises RequestError with a message naming the field.

    Unknown fields are ignored (clients send `model`, `user`, ...); options this
    server cannot honour (n > 1, echo, logprobs, best_of) are rejected."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("prompt is empty: give some text or a list of token ids")
        if tokenizer is None:
            raise RequestError("this model has no tokenizer: send the prompt as a list of token ids")
        prompt_ids = list(tokenizer(prompt).input_ids)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt_ids = list(prompt)
    elif prompt is None:
        raise RequestError("missing field 'prompt' (a string or a list of token ids)")
    else:
        raise RequestError("prompt must be a string or a list of integer token ids (one prompt per request)")
    if not prompt_ids:
        raise RequestError("prompt is empty: give at least one token")
    for name, bad in (("n", lambda v: v != 1), ("best_of", lambda v: v != 1), ("echo", bool),
                      ("logprobs", lambda v: v is not None and v is not False),
                      ("suffix", lambda v: v is not None)):
        if name in body and bad(body[name]):
            raise RequestError(f"{name}={body[name]!r} is not supported by this server")
    params = SamplingParams(
        max_new_tokens=_number(body, "max_tokens", int, default_max_tokens),
        temperature=float(_number(body, "temperature", float, 0.0)),
        top_p=float(_number(body, "top_p", float, 1.0)),
        seed=_number(body, "seed", int, None),
    )
    params.validate()
    if params.temperature > 100:
        raise RequestError(f"temperature must be <= 100, got {params.temperature}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {stream!r}")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop must be a non-empty string or a list of up to 4 non-empty strings")
    meta = body.get("metadata")
    tag = meta.get("tag") if isinstance(meta, dict) and meta.get("tag") is not None else body.get("user")
    if tag is not None and not isinstance(tag, str):
        raise RequestError(f"the tag (metadata.tag or user) must be a string, got {tag!r}")
    return CompletionRequest(prompt_ids, params, stream, stop, tag)


def _number(body: dict, name: str, kind: type, default: Any) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    ok = isinstance(v, int) if kind is int else isinstance(v, int | float)
    if isinstance(v, bool) or not ok:
        raise RequestError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {v!r}")
    return v


def _finish_reason(ts: TextStream, res: GenerationResult) -> str:
    """OpenAI's finish_reason: "stop" for EOS and for stop strings, else "length"."""
    return "stop" if ts.stopped or res.finish_reason == STOP_STRING else res.finish_reason


class TextStream:
    """Incremental detokenisation with stop strings: `push` returns the text to send now.

    Text is decoded from all tokens so far (so multi-token characters come out
    whole), and the tail that could still turn into a stop string is held back."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False
        self._hold = max((len(s) for s in stop), default=1) - 1

    def push(self, ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.ids += ids
        if self.tokenizer is None:
            return ""
        # An incomplete UTF-8 sequence at the end decodes as U+FFFD: leave it out until a later
        # token completes it (and out of the final text when generation ends inside it).
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True).rstrip("\ufffd")
        cuts = [i for i in (text.find(s, max(0, self.sent - self._hold)) for s in self.stop) if i >= 0]
        if cuts:
            self.text, self.stopped = text[: min(cuts)], True
            return self.flush()
        self.text = text
        upto = max(self.sent, len(text) - self._hold)
        out, self.sent = text[self.sent:upto], upto
        return out

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


class CompletionServer:
    """Serves `engine` over HTTP. `start` returns once the socket is listening.

    `swapper` (optional) gets every finished request's acceptance (`observe`) and
    its status is exported; `sink` is only read for its drop counters (the engine emits)."""

    def __init__(
        self,
        engine: SpeculativeEngine,
        tokenizer: Any,
        *,
        model_id: str,
        options: ServerOptions | None = None,
        swapper: HotSwapper | None = None,
        sink: object | None = None,
    ) -> None:
        self.engine, self.tokenizer, self.model_id = engine, tokenizer, model_id
        self.options = options or ServerOptions()
        self.swapper = swapper
        self.queue: FairQueue[_Job] = FairQueue(self.options.max_queue, self.options.max_queue_per_client)
        self.metrics = ServerMetrics(
            version=self.drafter_version,
            swapper_status=(lambda: swapper.status()) if swapper else (lambda: None),
            sink=sink, queue_depth=lambda: len(self.queue),
        )
        self._accepting = True
        self._inflight = 0
        self._inflight_cond = threading.Condition()
        self._httpd = ThreadingHTTPServer((self.options.host, self.options.port), _Handler)
        self._httpd.daemon_threads = True  # idle keep-alive connections must not block shutdown
        self._httpd.app = self  # type: ignore[attr-defined]
        self._threads: list[threading.Thread] = []

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        host = self.options.host if self.options.host not in ("0.0.0.0", "") else "127.0.0.1"
        return f"http://{host}:{self.port}"

    def drafter_version(self) -> str:
        return self.swapper.version if self.swapper else str(getattr(self.engine.slot.get(), "version", "?"))

    def start(self) -> None:
        for target, name in ((self._work, "livedraft-engine"), (self._httpd.serve_forever, "livedraft-http")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        log.info("serving %s on %s (drafter %s)", self.model_id, self.url, self.drafter_version())

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Drains: refuses new completions (503), finishes queued and running ones, then closes
        the socket. Blocks up to `timeout_s`; returns False when requests were still running."""
        deadline = time.monotonic() + timeout_s
        self._accepting = False
        with self._inflight_cond:
            drained = self._inflight_cond.wait_for(lambda: self._inflight == 0, timeout_s)
        self.queue.close()
        for job in self._drain_queue():  # only left when the wait timed out
            job.cancelled = True
        self._httpd.shutdown()
        self._httpd.server_close()
        for t in self._threads:
            t.join(max(0.1, deadline - time.monotonic()))
        if not drained:
            log.warning("server stopped with requests still running after %.0fs", timeout_s)
        return drained

    def _drain_queue(self) -> list[_Job]:
        out = []
        while (job := self.queue.get(timeout_s=0)) is not None:
            out.append(job)
        return out

    # -- the engine worker ------------------------------------------------------

    def _work(self) -> None:
        while (job := self.queue.get()) is not None:
            try:
                self._run(job)
            except BaseException:  # never let one request kill the worker
                log.exception("engine worker failed on %s", job.id)
                job.error = job.error or (500, "server_error", "internal error while generating; see server log")
            finally:
                job.chunks.put(_DONE)
                job.done.set()

    def _run(self, job: _Job) -> None:
        if job.cancelled:
            return

        # With stop strings the worker decodes as it goes, so generation ends at one; the
        # handler then uses this text. Without, the handler thread decodes (off the engine loop).
        ts = job.text = TextStream(self.tokenizer, job.req.stop)

        def on_tokens(ids: list[int]) -> bool:
            if job.cancelled:
                raise _Cancelled
            text = ts.push(ids) if job.req.stop else None
            if job.req.stream:
                job.chunks.put((ids, text))
            return ts.stopped

        try:
            res = self.engine.generate(job.req.prompt_ids, job.req.params, request_id=job.id,
                                       tag=job.req.tag, on_tokens=on_tokens)
        except _Cancelled:
            return
        except RequestError as e:
            job.error = (400, "invalid_request_error", str(e))
            return
        job.result = res
        version = res.trace.drafter_version
        self.metrics.record_result(version, res.stats, time.perf_counter() - job.queued_at)
        if self.swapper is not None:
            try:
                self.swapper.observe(version, res.stats)
            except Exception:
                log.exception("hot-swap observe failed after %s", job.id)

    # -- request side ----------------------------------------------------------

    def submit(self, req: CompletionRequest, client: str) -> _Job:
        """Queues a validated request. Raises QueueFull (429/503) or RequestError."""
        if not self._accepting:
            raise QueueFull("the server is shutting down: retry later", 503)
        self.engine.validate(req.prompt_ids, req.params)  # fail fast, before taking a queue place
        job = _Job(req, client)
        self.queue.put(client, job)
        return job

    def enter(self) -> None:
        with self._inflight_cond:
            self._inflight += 1

    def leave(self) -> None:
        with self._inflight_cond:
            self._inflight -= 1
            self._inflight_cond.notify_all()

    def response(self, job: _Job) -> dict[str, Any]:
        res, ts = job.result, job.text
        if not job.req.stop:
            ts.push(res.output_ids)  # one decode of the whole output
        return {
            "id": job.id, "object": "text_completion", "created": int(job.created), "model": self.model_id,
            "choices": [{"text": ts.text, "index": 0, "logprobs": None,
                         "finish_reason": _finish_reason(ts, res)}],
            "usage": _usage(res), "livedraft": self.livedraft_info(res),
        }

    def livedraft_info(self, res: GenerationResult) -> dict[str, Any]:
        return {"drafter_version": res.trace.drafter_version, "output_ids": res.output_ids,
                "stats": res.stats.to_dict()}

    def drafter_status(self) -> dict[str, Any]:
        if self.swapper is None:
            return {"version": self.drafter_version(), "hot_swap": False, "history": []}
        return {**self.swapper.status(), "hot_swap": True}


def _usage(res: GenerationResult) -> dict[str, int]:
    p, c = len(res.prompt_ids), len(res.output_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "livedraft"

    @property
    def app(self) -> CompletionServer:
        return self.server.app  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        try:
            if path == "/healthz":
                ok = self.app._accepting
                self._json(200 if ok else 503, {"status": "ok" if ok else "draining", "model": self.app.model_id,
                                                "drafter_version": self.app.drafter_version(),
                                                "queue_depth": len(self.app.queue)})
            elif path == "/metrics":
                self._send(200, self.app.metrics.render(), CONTENT_TYPE)
            elif path == "/v1/drafter":
                self._json(200, self.app.drafter_status())
            elif path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": self.app.model_id, "object": "model",
                                                             "owned_by": "livedraft"}]})
            else:
                self._error(404, "not_found", f"no route GET {path}: try /v1/completions, /healthz, /metrics, /v1/drafter")
        except Exception:
            log.exception("GET %s failed", path)
            self._error(500, "server_error", "internal error; see server log")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if path != "/v1/completions":
            self._discard_body()
            self._error(404, "not_found", f"no route POST {path}: completions are at POST /v1/completions")
            return
        self.app.enter()
        status, recorded = "error", False
        try:
            status, respond = self._completion()
            if respond is not None:
                # Counted before the client can read the response: a scrape right after it sees it.
                self.app.metrics.record_request(status)
                recorded = True
                respond()
        except (BrokenPipeError, ConnectionResetError):
            status = "cancelled"
        except Exception:
            log.exception("POST /v1/completions failed")
            try:
                self._error(500, "server_error", "internal error; see server log")
            except OSError:
                pass
        finally:
            if not recorded:
                self.app.metrics.record_request(status)
            self.app.leave()

    def _completion(self) -> tuple[str, Callable[[], None] | None]:
        """(metrics status, the call that writes the response); a stream is written here (None)."""
        app = self.app
        try:
            body = self._read_json()
            req = parse_completion(body, tokenizer=app.tokenizer, default_max_tokens=app.options.default_max_tokens)
            req.tag = self.headers.get("X-Livedraft-Tag") or req.tag
            job = app.submit(req, self._client())
        except _HttpError as e:
            return "bad_request", partial(self._error, e.status, e.kind, str(e))
        except RequestError as e:
            return "bad_request", partial(self._error, 400, "invalid_request_error", str(e))
        except QueueFull as e:
            kind = "rate_limit_error" if e.status == 429 else "server_overloaded"
            return "rejected", partial(self._error, e.status, kind, str(e))
        if req.stream:
            return self._stream(job), None
        if not job.done.wait(app.options.request_timeout_s):
            job.cancelled = True
            msg = f"the request did not finish within {app.options.request_timeout_s:.0f}s"
            return "error", partial(self._error, 504, "timeout", msg)
        return self._finish(job)

    def _finish(self, job: _Job) -> tuple[str, Callable[[], None]]:
        if job.error:
            status, kind, msg = job.error
            return "bad_request" if status < 500 else "error", partial(self._error, status, kind, msg)
        if job.result is None:
            return "cancelled", partial(self._error, 503, "server_overloaded",
                                        "the request was dropped while the server shut down")
        return "ok", partial(self._json, 200, self.app.response(job))

    def _stream(self, job: _Job) -> str:
        app = self.app
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        deadline = time.monotonic() + app.options.request_timeout_s
        base = {"id": job.id, "object": "text_completion", "created": int(job.created), "model": app.model_id}
        try:
            while True:
                try:
                    chunk = job.chunks.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    job.cancelled = True
                    self._event({"error": {"message": "the request timed out", "type": "timeout"}})
                    return "error"
                if chunk is _DONE:
                    break
                ids, text = chunk
                if text is None:
                    text = job.text.push(ids)
                self._event({**base, "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": None}],
                             "livedraft": {"token_ids": ids}})
            job.done.wait()
            if job.error or job.result is None:
                status, kind, msg = job.error or (503, "server_overloaded", "dropped while the server shut down")
                self._event({"error": {"message": msg, "type": kind}})
                return "bad_request" if status < 500 else "error"
            res, ts = job.result, job.text
            self._event({**base, "choices": [{"text": ts.flush(), "index": 0, "logprobs": None,
                                              "finish_reason": _finish_reason(ts, res)}],
                         "usage": _usage(res), "livedraft": app.livedraft_info(res)})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            return "ok"
        except OSError:
            job.cancelled = True  # the client went away: stop generating for it
            return "cancelled"

    def _event(self, obj: dict[str, Any]) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()

    def _client(self) -> str:
        return self.headers.get("X-Client-Id") or self.client_address[0]

    def _read_json(self) -> Any:
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked" or length is None:
            self.close_connection = True
            raise _HttpError(411, "invalid_request_error", "send the body with a Content-Length header")
        try:
            n = int(length)
        except ValueError:
            self.close_connection = True
            raise _HttpError(400, "invalid_request_error", f"bad Content-Length {length!r}") from None
        if n > self.app.options.max_body_bytes:
            self.close_connection = True
            raise _HttpError(413, "invalid_request_error",
                             f"request body is {n} bytes; the limit is {self.app.options.max_body_bytes}")
        raw = self.rfile.read(n)
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _HttpError(400, "invalid_request_error", f"the body is not valid JSON: {e}") from None

    def _discard_body(self) -> None:
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = 0
        if 0 < n <= self.app.options.max_body_bytes:
            self.rfile.read(n)
        elif n:
            self.close_connection = True

    def _error(self, status: int, kind: str, message: str) -> None:
        self._json(status, {"error": {"message": message, "type": kind}})

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _send(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)


class _HttpError(Exception):
    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind = status, kind
