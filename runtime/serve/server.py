"""The server in front of one engine: an OpenAI-compatible completions API with continuous batching,
API keys, tenants, metrics, drafter status and hot-swap, and an orderly drain.

Parts: runtime/serve/protocol.py validates requests (typed models, trace-store limits),
runtime/serve/worker.py batches them through the engine in one thread, runtime/serve/textstream.py
decodes text as it streams, runtime/serve/http.py is the FastAPI app on uvicorn. This module ties
them together and owns the lifecycle.

Trace durability: a finished request's trace is handed to the event sink as the engine
retires it, before the response is written; the sink makes it durable asynchronously (for
the embedded stream, when its writer commits; Kafka, when the broker acknowledges). A crash
between the response and that commit loses the trace, and /metrics counts what the sink
dropped or failed to deliver. With `durable_traces` the response waits until the sink has
flushed it (a slower answer, no answered request without its trace).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.errors import LivedraftError
from runtime.hotswap import HotSwapper
from runtime.inflight import InFlight
from runtime.serve.backend import ServingBackend
from runtime.serve.fairqueue import FairQueue
from runtime.serve.http import HttpServer, build_app
from runtime.serve.metrics import ServerMetrics
from runtime.serve.protocol import check_tag, finish_reason, livedraft_info, usage
from runtime.serve.textstream import TextStream
from runtime.serve.worker import CompletionRequest, EngineWorker, Job
from runtime.sinks import EventSink

log = logging.getLogger(__name__)


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000  # 0 = any free port
    max_queue: int = 64  # requests waiting, all clients; beyond it: 503
    max_queue_per_client: int = 16  # requests waiting per client; beyond it: 429
    max_body_bytes: int = 1 << 20
    max_header_bytes: int = 16384
    default_max_tokens: int = 64
    request_timeout_s: float = 300.0  # a request not finished by then gets a 504 (and is cancelled)
    read_timeout_s: float = 10.0  # the body must keep arriving: no chunk for this long -> 408
    header_timeout_s: float = 10.0  # a connection's request headers must complete within this
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> tenant tag ("": a tenant of its own); empty: open
    protect_metrics: bool = False  # with API keys, /metrics and /healthz need one too
    trust_client_id: bool = False  # key the fair queue by the X-Client-Id header (behind a trusted proxy)
    durable_traces: bool = False  # a response waits until its trace is flushed to the stream


def read_api_keys(api_key: str = "", keys_file: str = "") -> dict[str, str]:
    """Keys from `api_key` (a tenant of its own) and a keys file (JSON or TOML: {"key": "tenant", ...}).
    Raises LivedraftError on an unreadable file or a bad tenant name."""
    keys = {api_key: ""} if api_key else {}
    if keys_file:
        path = Path(keys_file).expanduser()
        try:
            text = path.read_text()
            table = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (OSError, ValueError) as e:
            raise LivedraftError(f"cannot read the API keys file {path}: {e}") from e
        if not isinstance(table, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in table.items()):
            raise LivedraftError(f"{path}: expected a table of \"key\" = \"tenant\" strings")
        for key, tenant in table.items():
            if len(key) < 8:
                raise LivedraftError(f"{path}: API keys must be at least 8 characters")
            try:
                check_tag(tenant or None)
            except Exception as e:
                raise LivedraftError(f"{path}: tenant {tenant!r:.40} is not a valid tag: {e}") from e
            keys[key] = tenant
    return keys


def job_queue(options: ServerOptions) -> FairQueue[Job]:
    """The fair queue a serving backend takes its jobs from, bounded by `options`."""
    return FairQueue(options.max_queue, options.max_queue_per_client)


class CompletionServer:
    """Serves a backend (our engine's EngineWorker, or llama-server's worker) over HTTP. `start`
    returns once the socket is listening.

    `swapper` (optional) gets every finished request's acceptance (`observe`) and its status is
    exported; `sink` is read for its drop counters and flushed for `durable_traces`."""

    def __init__(
        self,
        backend: ServingBackend,
        tokenizer: Any,
        *,
        model_id: str,
        options: ServerOptions | None = None,
        swapper: HotSwapper | None = None,
        sink: EventSink | None = None,
        dead_letters: Callable[[], int] | None = None,
    ) -> None:
        """`dead_letters`: the count of an in-process collector's dead letters, for /metrics."""
        self.tokenizer, self.model_id = tokenizer, model_id
        self.options = options or ServerOptions()
        self.swapper, self.sink = swapper, sink
        self.api_keys = dict(self.options.api_keys)
        self.worker = backend
        self.queue = backend.queue
        backend.attach(text_stream=lambda job: TextStream(self.tokenizer, job.req.stop), on_result=self._record)
        self.metrics = ServerMetrics(
            version=self.drafter_version,
            swapper_status=(lambda: swapper.status()) if swapper else (lambda: None),
            sink=sink, queue_depth=lambda: len(self.queue), running=lambda: backend.running,
            dead_letters=dead_letters,
        )
        self.inflight = InFlight()  # requests the HTTP layer is answering (entered / left there)
        o = self.options
        self.http = HttpServer(build_app(self), o.host, o.port, keep_alive_s=o.keep_alive_s,
                               header_timeout_s=o.header_timeout_s, max_header_bytes=o.max_header_bytes)

    @property
    def port(self) -> int:
        return self.http.port

    @property
    def url(self) -> str:
        host = self.options.host if self.options.host not in ("0.0.0.0", "", "::") else "127.0.0.1"
        return f"http://{host}:{self.port}"

    @property
    def accepting(self) -> bool:
        return self.worker.accepting

    def drafter_version(self) -> str:
        return self.swapper.version if self.swapper else self.worker.drafter_version()

    def encode(self, text: str) -> list[int] | None:
        return None if self.tokenizer is None else list(self.tokenizer(text).input_ids)

    def start(self) -> None:
        if "" in self.api_keys.values() and any(self.api_keys.values()):
            log.warning("API keys with and without a tenant are configured together: each key without one "
                        "is a tenant of its own (key-<hash>), and no client can choose another tenant's tag")
        self.worker.start()
        self.http.start()
        log.info("serving %s on %s (drafter %s, up to %d requests decoded together%s)", self.model_id, self.url,
                 self.drafter_version(), self.worker.max_batch, ", API keys required" if self.api_keys else "")

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Drains: refuses new completions (503), finishes queued and running ones, then closes
        the socket. Blocks up to `timeout_s`; returns False when requests were still running."""
        deadline = time.monotonic() + timeout_s
        self.worker.stop_accepting()
        drained = self.inflight.drain(timeout_s)
        for job in self.worker.close():  # only left when the wait timed out
            job.cancelled = True
            EngineWorker.finish(job)
        self.http.stop(max(0.1, deadline - time.monotonic()))
        self.worker.join(max(0.1, deadline - time.monotonic()))
        if not drained:
            log.warning("server stopped with requests still running after %.0fs", timeout_s)
        return drained

    # -- what the HTTP layer calls ----------------------------------------------------------

    def submit(self, req: CompletionRequest, client: str) -> Job:
        """Queues a validated request. Raises QueueFull (429/503) or RequestError."""
        return self.worker.submit(req, client)

    def enter(self) -> None:
        self.inflight.enter()

    def leave(self) -> None:
        self.inflight.leave()

    async def durable(self, job: Job) -> None:
        """With durable_traces: returns once the sink has flushed (the job's trace with it)."""
        if self.options.durable_traces and self.sink is not None:
            ok = await asyncio.to_thread(self.sink.flush, self.options.request_timeout_s)
            if ok is False:
                log.warning("trace of %s not confirmed durable within %.0fs", job.id, self.options.request_timeout_s)

    def response(self, job: Job) -> dict[str, Any]:
        res, ts = job.result, job.text
        if not job.req.stop:
            ts.push(res.output_ids)  # one decode of the whole output, off the engine thread
        return {
            "id": job.id, "object": "text_completion", "created": int(job.created), "model": self.model_id,
            "choices": [{"text": ts.text, "index": 0, "logprobs": None,
                         "finish_reason": finish_reason(ts.stopped, res)}],
            "usage": usage(res), "livedraft": livedraft_info(res),
        }

    def drafter_status(self) -> dict[str, Any]:
        if self.swapper is None:
            return {"version": self.drafter_version(), "hot_swap": False, "history": []}
        return {**self.swapper.status(), "hot_swap": True}

    def _record(self, job: Job) -> None:
        res = job.result
        version = res.trace.drafter_version
        self.metrics.record_result(version, res.stats, time.perf_counter() - job.queued_at)
        if self.swapper is not None:
            self.swapper.observe(version, res.stats)
