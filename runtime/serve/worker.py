"""EngineWorker: one thread owns the engine and batches requests continuously.

HTTP threads validate and queue jobs in a FairQueue (per client, round-robin, bounded:
its 429/503 semantics sit in front of the batch). The worker, between engine steps,
admits queued jobs into free rows (`max_batch`), steps every running request once,
and hands finished ones back; it never blocks on a client. Streamed tokens go to the
job's own queue from the step that produced them. A client that leaves is cancelled
at the next step boundary; the others keep running. A request keeps the drafter it
started with: a hot-swap installs the new version for jobs admitted after it, while
running rows finish on theirs (the engine drafts each version's rows with its own).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.engine import (
    CANCELLED,
    EngineStepError,
    GenerationResult,
    SamplingParams,
    SpeculativeEngine,
)
from runtime.errors import RequestError
from runtime.serve.fairqueue import FairQueue, QueueFull

log = logging.getLogger(__name__)

DONE = object()  # end of a job's token stream


@dataclass
class CompletionRequest:
    """A validated completion: what the engine needs, and how to return it."""

    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    stop: list[str] = field(default_factory=list)
    tag: str | None = None
    speculate: bool = True  # False: served by the target alone (a same-run baseline)


@dataclass
class Job:
    req: CompletionRequest
    client: str
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: float = field(default_factory=time.time)
    queued_at: float = field(default_factory=time.perf_counter)
    # (token ids, their text or None), then DONE; the text is there when the worker decoded it
    chunks: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    text: Any = None  # a TextStream over the completion, when the worker decodes (stop strings)
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    result: GenerationResult | None = None
    error: tuple[int, str, str] | None = None  # (status, type, message)
    notify: Callable[[], None] | None = None  # wakes the waiting HTTP coroutine (any thread may call it)

    def emit(self, item: Any) -> None:
        """Hands a chunk (or DONE) to whoever waits on this job."""
        self.chunks.put(item)
        if self.notify is not None:
            self.notify()


class EngineWorker:
    """Runs `engine` in one thread over jobs from a FairQueue (a runtime.serve.backend.ServingBackend).
    `text_stream(job)` returns the object whose `push(ids) -> text` and `stopped` decode a job
    with stop strings; `on_result(job)` runs after each finished job (metrics, hot-swap)."""

    def __init__(self, engine: SpeculativeEngine, queue_: FairQueue[Job], *,
                 text_stream: Callable[[Job], Any] | None = None,
                 on_result: Callable[[Job], None] = lambda job: None) -> None:
        self.engine, self.queue = engine, queue_
        self.text_stream, self.on_result = text_stream, on_result
        self.max_batch = engine.config.max_batch
        self._jobs: dict[str, Job] = {}
        self._accepting = True
        self._thread: threading.Thread | None = None
        self.batch_sizes: list[int] = []  # running rows per step (a bounded recent history)

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def running(self) -> int:
        return self.engine.running

    def drafter_version(self) -> str:
        return self.engine.slot.get().version

    def attach(self, *, text_stream: Callable[[Job], Any], on_result: Callable[[Job], None]) -> None:
        self.text_stream, self.on_result = text_stream, on_result

    def stop_accepting(self) -> None:
        """New submits get 503; queued and running jobs still finish."""
        self._accepting = False

    def submit(self, req: CompletionRequest, client: str) -> Job:
        """Queues a validated request. Raises QueueFull (429/503) or RequestError."""
        if not self._accepting:
            raise QueueFull("the server is shutting down: retry later", 503)
        self.engine.validate(req.prompt_ids, req.params)  # fail fast, before taking a queue place
        job = Job(req, client)
        self.queue.put(client, job)
        return job

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="livedraft-engine", daemon=True)
        self._thread.start()

    def close(self) -> list[Job]:
        """Stops admitting and closes the queue; returns the jobs still queued (not admitted)."""
        self._accepting = False
        return self.queue.close_and_take()

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    # -- the worker thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                if not self._loop_once():
                    return
            except Exception:  # a bug must not leave clients waiting forever: fail what is in flight
                log.exception("engine worker: unexpected error; failing %d request(s) in flight", len(self._jobs))
                self.engine.abandon_all()
                for job in self._jobs.values():
                    job.error = (500, "server_error", "internal error while generating; see server log")
                    self.finish(job)
                self._jobs.clear()

    def _loop_once(self) -> bool:
        """Admits, then steps once. False when the queue is closed and nothing is left."""
        if not self._jobs:
            job = self.queue.get()  # idle: wait for work (None: closed and empty)
            if job is None:
                return False
            self._admit(job)
        while len(self._jobs) < self.max_batch and (job := self.queue.get(timeout_s=0)) is not None:
            self._admit(job)
        for job in list(self._jobs.values()):
            if job.cancelled:
                self.engine.cancel(job.id)
        if self._jobs:
            self._step()
        return True

    def _admit(self, job: Job) -> None:
        if job.cancelled:
            self.finish(job)
            return

        def on_tokens(ids: list[int]) -> bool:
            if job.cancelled:  # the client left: ended at this step boundary
                self.engine.cancel(job.id)
                return False
            text = job.text.push(ids) if job.req.stop else None
            if job.req.stream:
                job.emit((ids, text))
            return bool(job.req.stop) and job.text.stopped

        try:
            job.text = self.text_stream(job)
            self.engine.add(job.req.prompt_ids, job.req.params, request_id=job.id, tag=job.req.tag,
                            on_tokens=on_tokens, speculate=job.req.speculate)
        except RequestError as e:
            job.error = (400, "invalid_request_error", str(e))
            self.finish(job)
            return
        except Exception:  # a drafter failing to begin a request fails that request only
            log.exception("engine could not start %s", job.id)
            job.error = (500, "server_error", "internal error while starting the request; see server log")
            self.finish(job)
            return
        self._jobs[job.id] = job

    def _step(self) -> None:
        self.batch_sizes = (self.batch_sizes + [len(self._jobs)])[-1000:]
        try:
            results = self.engine.step()
        except EngineStepError as e:
            log.error("engine step failed; %d request(s) fail: %r", len(e.request_ids), e.cause, exc_info=e.cause)
            for rid in e.request_ids:
                job = self._jobs.pop(rid, None)
                if job is not None:
                    job.error = (500, "server_error", "internal error while generating; see server log")
                    self.finish(job)
            return
        for res in results:
            job = self._jobs.pop(res.request_id, None)
            if job is None:
                continue
            if res.finish_reason != CANCELLED:
                job.result = res
                try:
                    self.on_result(job)
                except Exception:
                    log.exception("result hook failed after %s", job.id)
            self.finish(job)

    @staticmethod
    def finish(job: Job) -> None:
        """Marks `job` done and wakes its waiter."""
        job.done.set()
        job.emit(DONE)
