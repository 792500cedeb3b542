"""The HTTP layer of `livedraft serve`: a FastAPI app on uvicorn (as vLLM's OpenAI server).

uvicorn owns HTTP parsing, keep-alive and connection handling (asyncio: an idle or slow
connection holds no thread). On top of it:

- limits: body size (Content-Length checked before reading, chunked bodies counted while
  reading; h11 rejects a negative or malformed Content-Length), a read deadline per body chunk
  (408), a deadline for a request's headers (the connection is closed), header size
  (`h11_max_incomplete_event_size`), JSON nesting depth (checked before parsing);
- every error, protocol-level ones included, is a JSON body `{"error": {"message", "type"}}`;
- `Authorization: Bearer` API keys on every /v1 route (optionally mapped to tenants, whose tag
  the client cannot choose); /metrics and /healthz stay open unless configured otherwise;
- the engine never waits on a socket: the worker thread hands tokens to a job's queue and
  wakes the request's coroutine through the event loop.

Routes: POST /v1/completions, GET /v1/models, GET /v1/drafter, GET /healthz, GET /metrics.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import h11
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from runtime.errors import RequestError
from runtime.serve.fairqueue import QueueFull
from runtime.serve.metrics import CONTENT_TYPE
from runtime.serve.protocol import (
    check_tag,
    error_body,
    finish_reason,
    json_depth_ok,
    livedraft_info,
    parse_completion,
    usage,
)
from runtime.serve.worker import DONE, Job

if TYPE_CHECKING:
    from runtime.serve.server import CompletionServer

log = logging.getLogger(__name__)

MAX_URL_CHARS = 8192


class HttpError(Exception):
    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


def _json_error(status: int, kind: str, message: str, *, close: bool = False) -> JSONResponse:
    headers = {"Connection": "close"} if close else None
    if status == 401:
        headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
    return JSONResponse(error_body(message, kind), status_code=status, headers=headers)


class _LingeringTransport:
    """A connection's transport as uvicorn's h11 protocol and request cycle see it. A close while
    the client may still be sending (their h11 state SEND_BODY: an answer before the whole body,
    413 or 408; or ERROR: malformed HTTP answered with 400, 414 or 431) happens in stages (RFC 9112
    section 9.6): the write side first, after what is buffered, then what still arrives is dropped
    until the client closes or `linger_s` passes. Closing at once with the client's bytes unread
    makes the kernel answer them with a reset, which can destroy the answer before it is read.
    Every other close, and everything else, is the transport's own."""

    def __init__(self, transport: asyncio.Transport, protocol: JsonErrorProtocol) -> None:
        self._transport, self._protocol = transport, protocol
        self.lingering = False

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401 - whatever the transport has
        return getattr(self._transport, name)

    def close(self) -> None:
        if self.lingering:
            return  # closes when the client does, or at the end of linger_s
        sending = self._protocol.conn.their_state in (h11.SEND_BODY, h11.ERROR)
        if not sending or self._transport.is_closing() or not self._transport.can_write_eof():
            self._transport.close()
            return
        self.lingering = True
        self._transport.write_eof()
        self._protocol.loop.call_later(self._protocol.linger_s, self._transport.close)


class JsonErrorProtocol(H11Protocol):
    """uvicorn's h11 protocol, answering malformed HTTP (bad request line, headers too large, a
    negative Content-Length, an unsupported version) with a JSON body, closing a connection
    whose request headers do not complete within `header_timeout_s`, and closing after an
    answer sent while the client is still sending in stages (_LingeringTransport)."""

    header_timeout_s = 10.0
    linger_s = 2.0  # after an error answer, how long to drop what the client still sends before closing

    def connection_made(self, transport: Any) -> None:  # noqa: ANN401 - asyncio's transport
        super().connection_made(_LingeringTransport(transport, self))
        self._arm_header_timer()
        self._error_hint = 400
        self._line_seen = False  # the current request line has ended (a newline arrived)
        next_event = self.conn.next_event

        def remembering_next_event() -> Any:  # noqa: ANN401 - an h11 event
            # uvicorn answers every h11 protocol error with a plain 400; keep h11's own status hint
            # (431 for headers past the size limit) for send_400_response
            try:
                return next_event()
            except h11.RemoteProtocolError as e:
                self._error_hint = e.error_status_hint
                raise

        self.conn.next_event = remembering_next_event

    def data_received(self, data: bytes) -> None:
        if self.transport.lingering:
            return  # the answer is sent: what still arrives is dropped
        self._line_seen = self._line_seen or b"\n" in data
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.cycle is not self._armed_cycle:  # a request's headers arrived
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._line_seen = False
        self._arm_header_timer()  # the next request on this connection

    def send_400_response(self, msg: str) -> None:
        too_large = self._error_hint == 431  # the request line and headers passed the size limit
        if too_large and not self._line_seen:  # the request line alone: however its bytes arrived, a 414
            status, reason, text = 414, b"URI Too Long", f"the URL is longer than {MAX_URL_CHARS} characters"
        elif too_large:
            status, reason, text = 431, b"Request Header Fields Too Large", "request headers are too large"
        else:
            status, reason, text = 400, b"Bad Request", f"malformed HTTP request: {msg}"
        body = json.dumps(error_body(text, "invalid_request_error")).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        for event in (h11.Response(status_code=status, headers=headers, reason=reason), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()  # lingers: the client's state is ERROR

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._armed_cycle = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
        self._header_timer = None

    def _headers_late(self) -> None:
        if self.cycle is self._armed_cycle and not self.transport.is_closing():
            log.debug("closing a connection whose request headers did not arrive in %.0fs", self.header_timeout_s)
            self.transport.close()


def build_app(server: CompletionServer) -> FastAPI:
    opts = server.options
    # no /openapi.json (it would be served without a key) and no trailing-slash redirects (their
    # Location would be built from the client's Host header)
    app = FastAPI(title="livedraft", version="0.2", docs_url=None, redoc_url=None, openapi_url=None,
                  redirect_slashes=False)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request_error")
        hint = " (routes: POST /v1/completions, GET /v1/models, /v1/drafter, /healthz, /metrics)" \
            if exc.status_code in (404, 405) else ""
        return _json_error(exc.status_code, kind, f"{exc.detail}{hint}")

    @app.exception_handler(HttpError)
    async def _refused(_req: Request, exc: HttpError) -> JSONResponse:
        return _json_error(exc.status, exc.kind, str(exc))

    @app.middleware("http")
    async def _limits(request: Request, call_next: Any) -> Response:  # noqa: ANN401 - Starlette's callable
        if len(request.url.path) + len(request.url.query) > MAX_URL_CHARS:
            return _json_error(414, "invalid_request_error", f"the URL is longer than {MAX_URL_CHARS} characters",
                               close=True)
        size = sum(len(k) + len(v) for k, v in request.scope["headers"])
        if size > opts.max_header_bytes:
            return _json_error(431, "invalid_request_error",
                               f"request headers are {size} bytes; the limit is {opts.max_header_bytes}", close=True)
        return await call_next(request)

    @app.exception_handler(Exception)
    async def _crash(_req: Request, exc: Exception) -> JSONResponse:
        log.error("request failed", exc_info=exc)
        return _json_error(500, "server_error", "internal error; see server log")

    def principal(request: Request) -> tuple[str, str | None]:
        """(fair-queue client, tenant tag or None). Raises HttpError 401 without a valid key."""
        keys = server.api_keys
        if keys:
            auth = request.headers.get("authorization", "")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            tenant = _match(keys, token)
            if tenant is None:
                raise HttpError(401, "authentication_error", "missing or invalid API key: send "
                                "'Authorization: Bearer <key>'")
            # a key without a tenant is a tenant of its own: with keys configured, nothing a client
            # sends (tag header, metadata.tag, user) chooses which tenant's caches it reads or writes
            tenant = tenant or own_tenant(token)
            return f"tenant:{tenant}", tenant
        client = request.headers.get("x-client-id") if opts.trust_client_id else None
        return client or (request.client.host if request.client else "unknown"), None

    def guard_open_route(request: Request) -> None:
        if opts.protect_metrics and server.api_keys:
            principal(request)

    @app.get("/healthz")
    async def healthz(request: Request) -> Response:
        guard_open_route(request)
        ok = server.accepting
        return JSONResponse({"status": "ok" if ok else "draining", "model": server.model_id,
                             "drafter_version": server.drafter_version(), "queue_depth": len(server.queue),
                             "running": server.worker.running}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        guard_open_route(request)
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        principal(request)
        return JSONResponse({"object": "list", "data": [{"id": server.model_id, "object": "model",
                                                         "owned_by": "livedraft"}]})

    @app.get("/v1/drafter")
    async def drafter(request: Request) -> Response:
        principal(request)
        return JSONResponse(server.drafter_status())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        status, streaming, entered = "error", False, False
        try:
            try:
                client, tenant = principal(request)
                obj = await _read_json(request, opts.max_body_bytes, opts.read_timeout_s)
                # counted for the drain only once its body is in: a shutdown never waits on a client
                # that is still sending (submit refuses it once draining)
                server.enter()
                entered = True
                req = await asyncio.to_thread(parse_completion, obj, encode=server.encode,
                                              default_max_tokens=opts.default_max_tokens)
                if tenant is not None:
                    req.tag = tenant  # bound to the key: a client cannot choose another tenant's tag
                elif (header := _header_utf8(request, b"x-livedraft-tag")) is not None:
                    req.tag = check_tag(header)
                job = server.submit(req, client)
            except ClientGone:
                status = "cancelled"
                return Response(status_code=499)
            except HttpError as e:
                status = "rejected" if e.status == 401 else "bad_request"
                return _json_error(e.status, e.kind, str(e), close=e.status in (408, 413))
            except RequestError as e:
                status = "bad_request"
                return _json_error(400, "invalid_request_error", str(e))
            except QueueFull as e:
                status = "rejected"
                return _json_error(e.status, "rate_limit_error" if e.status == 429 else "server_overloaded", str(e))
            if req.stream:
                streaming = True
                return StreamingResponse(_sse(server, job, request), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"})
            status, response = await _complete(server, job, request)
            return response
        finally:
            if not streaming:
                server.metrics.record_request(status)
                if entered:
                    server.leave()

    return app


def own_tenant(key: str) -> str:
    """The tenant of an API key configured without one: derived from the key, never the key."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _header_utf8(request: Request, name: bytes) -> str | None:
    """A header's value decoded as UTF-8 (Starlette decodes Latin-1). Raises RequestError."""
    for key, value in request.scope["headers"]:
        if key == name:
            try:
                return value.decode("utf-8")
            except UnicodeDecodeError:
                raise RequestError(f"the {name.decode()} header is not valid UTF-8") from None
    return None


def _match(keys: dict[str, str], token: str) -> str | None:
    """The tenant of `token` ("" for a key without one), None when no key matches (constant time
    per key)."""
    found = None
    for key, tenant in keys.items():
        if hmac.compare_digest(key.encode(), token.encode()):
            found = tenant
    return found


async def _read_json(request: Request, max_bytes: int, timeout_s: float) -> Any:
    """The request's JSON body. Raises HttpError: 400 (not UTF-8 JSON, too deep), 408 (a chunk, or
    the whole body, not in time: the body must arrive within 3 x `timeout_s` in all), 413, and
    499 for a client that left while sending (ClientGone)."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise HttpError(400, "invalid_request_error", f"bad Content-Length {length!r:.40}")
        if int(length) > max_bytes:
            raise HttpError(413, "invalid_request_error",
                            f"request body is {length} bytes; the limit is {max_bytes}")
    chunks, total = [], 0
    stream = request.stream().__aiter__()
    deadline = time.monotonic() + 3 * timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), max(0.0, min(timeout_s, left)))
        except StopAsyncIteration:
            break
        except ClientDisconnect:
            raise ClientGone() from None
        except TimeoutError:
            what = f"within {timeout_s:g}s" if left > timeout_s else f"in full within {3 * timeout_s:g}s"
            raise HttpError(408, "timeout", f"the request body did not arrive {what}") from None
        total += len(chunk)
        if total > max_bytes:
            raise HttpError(413, "invalid_request_error", f"request body exceeds the limit of {max_bytes} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    return await asyncio.to_thread(_parse_json, raw) if len(raw) > 65536 else _parse_json(raw)


def _parse_json(raw: bytes) -> Any:
    """UTF-8 JSON only (json.loads would also read UTF-16/32, past the depth check's byte scan);
    large bodies are parsed off the event loop by the caller."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HttpError(400, "invalid_request_error", f"the body is not UTF-8 JSON: {e}") from None
    if not json_depth_ok(raw):
        raise HttpError(400, "invalid_request_error", "the JSON body nests deeper than 64 levels")
    try:
        return json.loads(text)
    except RecursionError:
        raise HttpError(400, "invalid_request_error", "the JSON body nests too deeply") from None
    except ValueError as e:
        raise HttpError(400, "invalid_request_error", f"the body is not valid JSON: {e}") from None


class ClientGone(Exception):
    """The client disconnected before its request body was complete (not a server error)."""


class _Wake:
    """Wakes a coroutine from the worker thread (Job.notify)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.event = asyncio.Event()

    def __call__(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.event.set)
        except RuntimeError:  # the loop is gone (server stopping): nobody is waiting
            pass

    async def items(self, job: Job) -> AsyncIterator[Any]:
        """The job's chunks as the worker produces them, ending with DONE."""
        while True:
            self.event.clear()
            while not job.chunks.empty():
                item = job.chunks.get_nowait()
                yield item
                if item is DONE:
                    return
            await self.event.wait()


async def _complete(server: CompletionServer, job: Job, request: Request) -> tuple[str, Response]:
    wake = _Wake()
    job.notify = wake
    done = asyncio.ensure_future(_drain(wake, job))
    gone = asyncio.ensure_future(_disconnected(request))
    finished, _ = await asyncio.wait({done, gone}, timeout=server.options.request_timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    for t in (done, gone):
        t.cancel()
    if done not in finished:
        job.cancelled = True
        if gone in finished:
            return "cancelled", Response(status_code=499)
        return "error", _json_error(504, "timeout",
                                    f"the request did not finish within {server.options.request_timeout_s:.0f}s")
    if job.error:
        st, kind, msg = job.error
        return ("bad_request" if st < 500 else "error"), _json_error(st, kind, msg)
    if job.result is None:
        return "cancelled", _json_error(503, "server_overloaded", "the request was dropped while the server shut down")
    await server.durable(job)
    return "ok", JSONResponse(server.response(job))


async def _drain(wake: _Wake, job: Job) -> None:
    async for _ in wake.items(job):
        pass


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse(server: CompletionServer, job: Job, request: Request) -> AsyncIterator[bytes]:
    wake = _Wake()
    job.notify = wake
    base = {"id": job.id, "object": "text_completion", "created": int(job.created), "model": server.model_id}
    deadline = time.monotonic() + server.options.request_timeout_s
    status = "error"
    try:
        items = wake.items(job).__aiter__()
        while True:
            try:
                chunk = await asyncio.wait_for(items.__anext__(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                job.cancelled = True
                yield _event(error_body("the request timed out", "timeout"))
                return
            if chunk is DONE:
                break
            ids, text = chunk
            if text is None:
                text = job.text.push(ids)
            yield _event({**base, "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": None}],
                          "livedraft": {"token_ids": ids}})
        if job.error or job.result is None:
            st, kind, msg = job.error or (503, "server_overloaded", "dropped while the server shut down")
            status = "bad_request" if st < 500 else "error"
            yield _event(error_body(msg, kind))
            return
        await server.durable(job)
        res, ts = job.result, job.text
        yield _event({**base, "choices": [{"text": ts.flush(), "index": 0, "logprobs": None,
                                           "finish_reason": finish_reason(ts.stopped, res)}],
                      "usage": usage(res), "livedraft": livedraft_info(res)})
        yield b"data: [DONE]\n\n"
        status = "ok"
    except (asyncio.CancelledError, GeneratorExit):
        job.cancelled = True  # the client went away: stop generating for it
        status = "cancelled"
        raise
    finally:
        server.metrics.record_request(status)
        server.leave()


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class HttpServer:
    """uvicorn serving `app` from a thread, on a socket bound here (so port 0 resolves at once and a
    busy port fails in the caller)."""

    def __init__(self, app: FastAPI, host: str, port: int, *, keep_alive_s: float, header_timeout_s: float,
                 max_header_bytes: int) -> None:
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
            self.sock.listen(2048)
        except OSError:
            self.sock.close()
            raise
        protocol = type("Protocol", (JsonErrorProtocol,), {"header_timeout_s": header_timeout_s})
        config = uvicorn.Config(app, http=protocol, lifespan="off", log_level="warning", access_log=False,
                                timeout_keep_alive=max(1, round(keep_alive_s)),
                                h11_max_incomplete_event_size=max_header_bytes, timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="livedraft-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def start(self, timeout_s: float = 30.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)

    def stop(self, timeout_s: float) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.sock.close()
