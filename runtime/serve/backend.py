"""The serving engine boundary: what the HTTP server asks of the engine behind it.

Two implementations, chosen once at start-up: `runtime.serve.worker.EngineWorker` (livedraft's own
engine, continuous batching in one thread) and `runtime.llamacpp.worker.LlamaServerWorker`
(a supervised llama-server, fed livedraft's heads). Both take validated jobs from a FairQueue,
stream token chunks into each job, and finish it with a `GenerationResult` whose trace has
already been handed to the event sink — so the stream, and everything downstream of it,
never knows which engine served a request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from runtime.serve.fairqueue import FairQueue
from runtime.serve.worker import CompletionRequest, Job


class ServingBackend(Protocol):
    """Contract: `submit` never blocks (QueueFull -> 429/503, RequestError -> 400); every
    submitted job is finished exactly once (`Job.done` set, `DONE` emitted) with a result, an
    error (status, type, message) or as cancelled; `on_result(job)` runs after each successful
    job and must not block for long; `close` returns the jobs never started."""

    queue: FairQueue[Job]
    max_batch: int  # requests served together

    @property
    def accepting(self) -> bool: ...

    @property
    def running(self) -> int:
        """Requests being decoded now."""

    def drafter_version(self) -> str:
        """The drafter version new requests start with."""

    def attach(self, *, text_stream: Callable[[Job], Any], on_result: Callable[[Job], None]) -> None:
        """The server's hooks: `text_stream(job)` decodes a job's text (stop strings)."""

    def submit(self, req: CompletionRequest, client: str) -> Job: ...

    def start(self) -> None: ...

    def stop_accepting(self) -> None: ...

    def close(self) -> list[Job]: ...

    def join(self, timeout_s: float) -> None: ...
