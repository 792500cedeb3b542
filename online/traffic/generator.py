"""A small traffic generator for a livedraft server: open-loop requests at a rate, with a live line
of mean acceptance length, tokens/s and drafter version (from the responses' `livedraft` block).
With `baseline_every=N` every N-th request asks to be served by the target alone (`"speculate":
false`), so target-only tokens/s is measured in the same run, on the same server, beside the
drafted requests."""

from __future__ import annotations

import json
import queue
import statistics
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from runtime.errors import LivedraftError


@dataclass
class Completed:
    """One answered request."""

    index: int
    finished_at: float  # seconds since the run started
    drafter_version: str
    steps: int
    accepted: int
    output_ids: list[int]
    tokens_per_s: float = 0.0  # the server's own measure: output tokens / time in the engine
    speculate: bool = True  # False: a target-only baseline request


@dataclass
class TrafficReport:
    sent: int = 0
    completed: list[Completed] = field(default_factory=list)
    failed: int = 0
    errors: list[str] = field(default_factory=list)  # the first few error messages
    seconds: float = 0.0

    @staticmethod
    def mal(items: Sequence[Completed]) -> float:
        """vLLM's mean acceptance length over `items`: 1 + accepted / verify steps."""
        steps = sum(c.steps for c in items)
        return 1.0 + sum(c.accepted for c in items) / steps if steps else float("nan")

    def versions(self) -> list[str]:
        """Drafter versions in the order they first served a (drafted) request."""
        seen: list[str] = []
        for c in sorted(self.completed, key=lambda c: c.finished_at):
            if c.speculate and c.drafter_version not in seen:
                seen.append(c.drafter_version)
        return seen

    @staticmethod
    def tokens_per_s(items: Sequence[Completed]) -> float:
        """Median tokens/s of `items` (NaN for none)."""
        return statistics.median(c.tokens_per_s for c in items) if items else float("nan")


def complete(url: str, prompt: str | list[int], *, max_tokens: int, temperature: float = 0.0,
             tag: str | None = None, seed: int | None = None, timeout_s: float = 600.0,
             speculate: bool = True, api_key: str | None = None) -> dict:
    """POST /v1/completions; returns the JSON body. Raises LivedraftError with the server's message."""
    body: dict = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
    if not speculate:
        body["speculate"] = False
    if seed is not None:
        body["seed"] = seed
    if tag:
        body["metadata"] = {"tag": tag}
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url.rstrip("/") + "/v1/completions", data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:300]
        raise LivedraftError(f"HTTP {e.code} from {url}: {detail}") from None
    except (urllib.error.URLError, OSError) as e:
        raise LivedraftError(f"cannot reach {url}: {getattr(e, 'reason', e)}") from None


def run_traffic(
    url: str,
    prompts: Sequence[str | list[int]],
    *,
    rate: float = 1.0,
    max_tokens: int = 64,
    temperature: float = 0.0,
    tag: str | None = None,
    concurrency: int = 4,
    report_every_s: float = 5.0,
    on_line: Callable[[str], None] | None = print,
    stop: threading.Event | None = None,
    timeout_s: float = 600.0,
    baseline_every: int = 0,
    api_key: str | None = None,
    report: TrafficReport | None = None,
) -> TrafficReport:
    """Sends every prompt (request i scheduled at i / rate seconds; rate <= 0: as fast as
    `concurrency` allows), at most `concurrency` in flight. Blocks until all are answered or
    `stop` is set. Prints a live line every `report_every_s` through `on_line` (None: quiet).
    `baseline_every` N > 0: requests N-1, 2N-1, ... are served by the target alone. `report`:
    filled in as requests finish (another thread may watch it) and returned; default a new one."""
    report = TrafficReport() if report is None else report
    jobs: queue.Queue = queue.Queue()
    for i, p in enumerate(prompts):
        jobs.put((i, p))
    lock = threading.Lock()
    stop = stop or threading.Event()
    t0 = time.monotonic()

    def worker() -> None:
        while not stop.is_set():
            try:
                i, prompt = jobs.get_nowait()
            except queue.Empty:
                return
            if rate > 0 and stop.wait(max(0.0, t0 + i / rate - time.monotonic())):
                return
            with lock:
                report.sent += 1
            speculate = not (baseline_every > 0 and i % baseline_every == baseline_every - 1)
            try:
                body = complete(url, prompt, max_tokens=max_tokens, temperature=temperature, tag=tag,
                                timeout_s=timeout_s, speculate=speculate, api_key=api_key)
                ld = body.get("livedraft", {})
                s = ld.get("stats", {})
                done = Completed(i, time.monotonic() - t0, str(ld.get("drafter_version", "?")),
                                 int(s.get("steps", 0)), int(s.get("accepted", 0)), list(ld.get("output_ids", [])),
                                 float(s.get("tokens_per_s", 0.0)), speculate)
                with lock:
                    report.completed.append(done)
            except LivedraftError as e:
                with lock:
                    report.failed += 1
                    if len(report.errors) < 5:
                        report.errors.append(str(e))

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(max(1, concurrency))]
    for t in threads:
        t.start()
    last, last_n = t0, 0
    while alive := [t for t in threads if t.is_alive()]:
        alive[0].join(timeout=max(0.05, last + report_every_s - time.monotonic()))
        now = time.monotonic()
        if on_line is not None and now - last >= report_every_s:
            with lock:
                last_n = _print_line(report, now - t0, last_n, on_line)
            last = now
    report.seconds = time.monotonic() - t0
    if on_line is not None:
        _print_line(report, report.seconds, last_n, on_line)
    return report


def _print_line(report: TrafficReport, elapsed: float, last_n: int, on_line: Callable[[str], None]) -> int:
    done = sorted(report.completed, key=lambda c: c.finished_at)
    recent = [c for c in done[last_n:] if c.speculate]
    drafted = [c for c in done if c.speculate]
    version = drafted[-1].drafter_version if drafted else "-"
    base = [c for c in done if not c.speculate]
    speed = f"{_fmt(TrafficReport.tokens_per_s(recent), '.1f')} tok/s"
    if base:
        speed += f" (target alone: {_fmt(TrafficReport.tokens_per_s(base), '.1f')} tok/s)"
    on_line(f"[{elapsed:6.0f}s] {len(done)} done, {report.failed} failed | since last line: {len(recent)} requests, "
            f"mean acceptance length {_fmt(TrafficReport.mal(recent))}, {speed} | overall "
            f"{_fmt(TrafficReport.mal(drafted))} | drafter {version}")
    return len(done)


def _fmt(x: float, spec: str = ".2f") -> str:
    return "-" if x != x else format(x, spec)  # NaN: nothing measured yet


CHATML = "<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def chat_wrap(prompts: Sequence[str], template: str = CHATML) -> list[str]:
    """Prompts as single-turn chat text (ChatML, the format of SmolLM2 and many small instruct
    models) for a server that takes raw text: without it an instruct model often answers a
    bare sentence with end-of-turn at once."""
    return [template.format(prompt=p) for p in prompts]
