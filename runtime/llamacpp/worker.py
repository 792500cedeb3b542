"""LlamaServerWorker: the serving backend that forwards jobs to a supervised llama-server.

The same contract as our engine's EngineWorker (runtime/serve/backend.py): jobs come from the
server's FairQueue, up to `max_batch` at once (llama-server's slots decode them together);
each is forwarded as a streaming `/completion` with `return_tokens` and `n_probs`, its token
chunks are passed on as they arrive, and the finished request becomes a RequestTrace with the
same schema as our engine's — prompt and output ids, the target's top-k at every output
position (the soft labels), and the drafted / accepted counts from llama-server's `timings` —
handed to the event sink before the job finishes.

Failures: a client that leaves closes the upstream connection (llama-server cancels the
task); an upstream that dies fails the requests it was serving with a 503 naming the reason,
and a monitor restarts it while new requests wait (up to `wait_s`) for it to be healthy again.
Which upstream serves new requests is the `slot`'s (hot-swap: see runtime/llamacpp/swap.py).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from runtime.engine import STOP_STRING, GenerationResult
from runtime.errors import RequestError
from runtime.inflight import InFlight
from runtime.llamacpp.upstream import Upstream, UpstreamError
from runtime.serve.fairqueue import FairQueue, QueueFull
from runtime.serve.worker import CompletionRequest, EngineWorker, Job
from runtime.slot import DrafterSlot
from runtime.stats import RequestStats
from runtime.trace import DraftCounts, RequestTrace, Timings

log = logging.getLogger(__name__)

STOP_TYPES = {"eos": "stop", "limit": "length", "word": STOP_STRING}
STOP_GRACE = 4  # token chunks read past our stop string while waiting for llama-server's final message


class LlamaServerWorker:
    """A runtime.serve.backend.ServingBackend over the upstream in `slot` (an Upstream, swappable)."""

    def __init__(self, slot: DrafterSlot, queue_: FairQueue[Job], *, target_model: str,
                 sink: Any = None,  # noqa: ANN401
                 max_batch: int = 4, topk: int = 8, request_timeout_s: float = 300.0, wait_s: float = 30.0,
                 vocab_size: int | None = None, baseline: Callable[[], Upstream] | None = None,
                 max_context: int | None = None, start_timeout_s: float = 120.0) -> None:
        """`baseline()` starts a target-only llama-server for requests with `speculate` false (the
        same-run baseline), once, when the serving upstream drafts. A crashed upstream is restarted
        with `start_timeout_s` to become healthy ([engine] start_timeout_s: a large model loads slowly)."""
        self.slot, self.queue = slot, queue_
        self._make_baseline, self._baseline = baseline, None
        self.target_model, self.sink, self.max_batch, self.topk = target_model, sink, max_batch, topk
        self.request_timeout_s, self.wait_s, self.vocab_size = request_timeout_s, wait_s, vocab_size
        self.max_context = max_context  # a slot's context: prompt + completion must fit
        self.start_timeout_s = start_timeout_s
        self.text_stream: Callable[[Job], Any] | None = None
        self.on_result: Callable[[Job], None] = lambda job: None
        # (upstream, stats) of each finished request: the draft rule's live check (online.serving.llama)
        self.on_served: Callable[[Upstream, Any], None] = lambda up, stats: None
        self.restarts = 0
        self._accepting = True
        self._free = threading.Semaphore(max_batch)
        self._jobs = InFlight()  # jobs being forwarded now
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._restart_lock = threading.Lock()
        self._baseline_lock = threading.Lock()
        self._baseline_failure: tuple[float, str | None] = (0.0, None)  # when and why its last start failed

    # -- ServingBackend -----------------------------------------------------------------------

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def running(self) -> int:
        return self._jobs.count

    def drafter_version(self) -> str:
        return self.slot.get().version

    def attach(self, *, text_stream: Callable[[Job], Any], on_result: Callable[[Job], None]) -> None:
        self.text_stream, self.on_result = text_stream, on_result

    def submit(self, req: CompletionRequest, client: str) -> Job:
        if not self._accepting:
            raise QueueFull("the server is shutting down: retry later", 503)
        if self.vocab_size is not None and any(not 0 <= t < self.vocab_size for t in req.prompt_ids):
            raise RequestError(f"prompt holds token ids outside the target's vocabulary [0, {self.vocab_size})")
        req.params.validate()
        need = len(req.prompt_ids) + req.params.max_new_tokens
        if self.max_context is not None and need > self.max_context:
            raise RequestError(f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.params.max_new_tokens}) "
                               f"exceed the context of a llama-server slot ({self.max_context}): shorten them, or "
                               "raise [engine] ctx_per_slot")
        job = Job(req, client)
        self.queue.put(client, job)
        return job

    def start(self) -> None:
        for target, name in ((self._dispatch, "livedraft-llama-dispatch"), (self._monitor, "livedraft-llama-monitor")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop_accepting(self) -> None:
        self._accepting = False

    def close(self) -> list[Job]:
        self._accepting = False
        return self.queue.close_and_take()

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    # -- threads ------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        while True:
            self._free.acquire()
            job = self.queue.get()
            if job is None:  # closed and empty
                self._free.release()
                return
            threading.Thread(target=self._serve, args=(job,), name=f"livedraft-llama-{job.id[-6:]}",
                             daemon=True).start()

    def _monitor(self) -> None:
        """Restarts the serving upstream when its process died (a request or an idle check saw it)."""
        while not self._stop.wait(0.5):
            for up in (self.slot.get(), self._baseline):
                if up is not None and up.process is not None and not up.alive and not up.retired:
                    self._restart(up)

    def _restart(self, up: Upstream) -> None:
        with self._restart_lock:
            if up.alive or up.retired:
                return
            log.error("%s; restarting it", up.exit_reason())
            try:
                up.start(self.start_timeout_s)
                self.restarts += 1
                log.info("llama-server of drafter %s restarted on port %d", up.version, up.port)
            except UpstreamError as e:
                log.error("llama-server restart failed (retrying): %s", e)
                time.sleep(1.0)

    def _serve(self, job: Job) -> None:
        self._jobs.enter()
        up = None
        try:
            up = self._upstream(job.req.speculate)
            if job.cancelled:
                return
            self._wait_ready(up)
            self._forward(job, up)
        except UpstreamError as e:
            job.error = (503, "server_overloaded", f"the serving engine failed: {e}")
        except Exception:  # a bug must not leave the client waiting
            log.exception("llama-server request %s failed", job.id)
            job.error = (500, "server_error", "internal error while generating; see server log")
        finally:
            if up is not None:
                up.leave()
            self._jobs.leave()
            self._free.release()
            # as in our engine: what a request did is recorded (metrics, traces, the guard) before its
            # client is answered, so a client that reads /metrics after its answer sees its request
            if job.result is not None:
                for hook in (self.on_result, lambda j: self.on_served(up, j.result.stats)):
                    try:
                        hook(job)
                    except Exception:
                        log.exception("result hook failed after %s", job.id)
            EngineWorker.finish(job)

    def _upstream(self, speculate: bool) -> Upstream:
        """The upstream a request keeps to its end, entered (counted in flight there). A swap can
        retire the slot's upstream between `get` and `enter`; a retired one is left for the one
        that replaced it, so a request is never pinned to a process being stopped."""
        while True:
            up = self.slot.get() if speculate else self._target_only()
            up.enter()
            if not up.retired or not speculate or self.slot.get() is up:
                return up
            up.leave()

    def _target_only(self) -> Upstream:
        """The target-only upstream (`speculate` false) when the slot's drafts, started on first use.
        A start that fails fails this request with its reason, and for `wait_s` after it every
        other such request too, without a start of its own (no queue of minutes-long retries)."""
        up = self.slot.get()
        if up.launch.head is None or self._make_baseline is None:
            return up
        with self._baseline_lock:
            if self._baseline is None:
                failed_at, error = self._baseline_failure
                if error is not None and time.monotonic() - failed_at < self.wait_s:
                    raise UpstreamError(f"the target-only llama-server did not start: {error}")
                try:
                    self._baseline = self._make_baseline()
                except UpstreamError as e:
                    self._baseline_failure = (time.monotonic(), str(e))
                    raise
            return self._baseline

    def stop_upstreams(self) -> None:
        """Stops the target-only upstream this worker started (the slot's are the caller's)."""
        if self._baseline is not None:
            self._baseline.stop()

    def _wait_ready(self, up: Upstream) -> None:
        deadline = time.monotonic() + self.wait_s
        while not up.alive or up.restarting:
            if time.monotonic() > deadline:
                raise UpstreamError(f"llama-server (drafter {up.version}) is not running and did not come back "
                                    f"within {self.wait_s:.0f}s: {up.last_words()}")
            time.sleep(0.05)

    # -- one request --------------------------------------------------------------------------

    def _forward(self, job: Job, up: Upstream) -> None:
        req, p = job.req, job.req.params
        body = {"prompt": req.prompt_ids, "n_predict": p.max_new_tokens, "stream": True, "return_tokens": True,
                "n_probs": self.topk, "cache_prompt": True, "temperature": p.temperature, "top_p": p.top_p,
                "top_k": 0, "min_p": 0.0, "seed": -1 if p.seed is None else p.seed % (2**32),
                "samplers": ["top_p", "temperature"]}
        if req.stop:  # llama-server stops there too, so its final message (the draft counts) comes at once
            body["stop"] = list(req.stop)
        job.text = self.text_stream(job) if self.text_stream is not None else None
        t0, created = time.perf_counter(), time.time()
        out: list[int] = []
        topk: list[tuple[list[int], list[float]]] = []
        final: dict[str, Any] = {}
        stopped, past_stop = False, 0
        conn, resp = up.open_stream(body, self.request_timeout_s)
        try:
            for data in _sse_data(resp):
                if job.cancelled:  # the client left: closing the connection cancels the upstream task
                    return
                ids = [int(t) for t in data.get("tokens") or ()]
                if ids and stopped:  # past the stop string: the answer ended; llama-server's end is awaited
                    past_stop += 1
                    if past_stop > STOP_GRACE:  # it did not stop where we did: its counts are lost, not the time
                        break
                elif ids:
                    topk += _topk(data.get("completion_probabilities") or (), len(ids))
                    out += ids
                    text = job.text.push(ids) if req.stop else None
                    if req.stream:
                        job.emit((ids, text))
                    stopped = bool(req.stop and job.text.stopped)
                if data.get("stop"):
                    final = data
                    break
            else:
                raise UpstreamError(up.failure("llama-server ended the stream without a final message"))
        except OSError as e:
            raise UpstreamError(up.failure(f"llama-server connection failed: {e}")) from e
        finally:
            conn.close()
        finish = STOP_STRING if stopped else STOP_TYPES.get(final.get("stop_type", ""), "length")
        job.result = self._result(job, up, out, topk, final, finish, time.perf_counter() - t0, created)
        if self.sink is not None:
            self.sink.emit(job.result.trace)

    def _result(self, job: Job, up: Upstream, out: list[int], topk: list, final: dict, finish: str,
                total_s: float, created: float) -> GenerationResult:
        req, p = job.req, job.req.params
        timings = final.get("timings") or {}
        drafted, accepted = int(timings.get("draft_n") or 0), int(timings.get("draft_n_accepted") or 0)
        steps = max(len(out) - accepted, 0)  # each target forward yields its accepted drafts + one token
        processed = timings.get("prompt_n")  # prompt tokens evaluated; the rest came from llama-server's cache
        reused = max(len(req.prompt_ids) - int(processed), 0) if processed is not None else 0
        stats = RequestStats(prompt_tokens=len(req.prompt_ids), reused_prompt_tokens=reused, output_tokens=len(out),
                             steps=steps, drafted=drafted, accepted=accepted,
                             prefill_s=float(timings.get("prompt_ms") or 0.0) / 1000, total_s=total_s)
        trace = RequestTrace(
            request_id=job.id, prompt_ids=list(req.prompt_ids), output_ids=out, steps=[],
            target_model=self.target_model, drafter_version=up.version, temperature=p.temperature, top_p=p.top_p,
            seed=p.seed, max_new_tokens=p.max_new_tokens, finish_reason=finish, tag=req.tag,
            timings=Timings(prefill_s=stats.prefill_s, total_s=total_s), created_at=created,
            counts=DraftCounts(steps, drafted, accepted), position_topk=topk if len(topk) == len(out) else None,
        )
        return GenerationResult(job.id, trace.prompt_ids, out, finish, stats, trace)


def _sse_data(resp: Any) -> Any:  # noqa: ANN401 - an http.client response
    """The JSON objects of a server-sent event stream (`data: {...}` lines)."""
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        payload = line[6:]
        if payload == b"[DONE]":
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            raise UpstreamError(f"llama-server sent an event that is not JSON: {payload[:200]!r}") from None
        if "error" in obj:
            raise UpstreamError(f"llama-server error: {obj['error']}")
        yield obj


def _topk(probs: list, n: int) -> list[tuple[list[int], list[float]]]:
    """llama-server's per-token `top_logprobs` as (ids, logprobs) pairs, one per generated token."""
    out = []
    for item in probs[:n]:
        tops = item.get("top_logprobs") or []
        out.append(([int(t["id"]) for t in tops], [float(t["logprob"]) for t in tops]))
    return out
