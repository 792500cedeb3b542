"""`livedraft up --demo`: traffic of one domain, a number of requests (the loop learns per request,
so a slow machine takes longer rather than seeing fewer rounds) and until the loop has been seen (a
trainer round finished and, when it promoted a version, that version served), then the closing
table a newcomer reads — per drafter version, tokens/s against target-only requests served in the
same run."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from runtime.errors import LivedraftError

DEMO_BASELINE_EVERY = 4  # one request in four is served by the target alone: the same-run baseline


def trained_and_served(daemon: object, handle: object, registry: object, serve_s: float = 3.0) -> Callable[[], bool]:
    """The demo's "seen the loop" test: a trainer round has finished and, when one promoted a
    candidate, the server has swapped to the champion and served with it for `serve_s`
    (the swap is triggered early instead of waiting for the next poll)."""
    served_since: list[float] = []

    def check() -> bool:
        history = daemon.trainer.stats.history
        if not any(o.ok for o in history):
            return False
        swapper = handle.swapper
        if swapper is None or not any(o.status == "promoted" for o in history):
            return True
        try:
            champion = registry.champion_version()
        except Exception:  # the registry is a local SQLite file; a hiccup just means "not yet"
            return False
        if champion is None or swapper.version != str(champion):
            served_since.clear()
            swapper.trigger()
            return False
        if not served_since:
            served_since.append(time.monotonic())
        return time.monotonic() - served_since[0] >= serve_s

    return check


def run_demo(url: str, prompts: list[str], *, stop: threading.Event, trained: Callable[[], bool],
             requests: int, seconds: float | None, max_seconds: float, max_tokens: int, domain: str) -> str:
    """Sends `prompts` (greedy, one at a time) until `requests` have been answered (or, with
    `seconds`, for that long), and longer until `trained()`; at most `max_seconds` in all, or until
    `stop`. Returns demo_summary's table."""
    from online.traffic.generator import TrafficReport, run_traffic

    length = f"for {seconds:.0f}s" if seconds is not None else f"for {requests} requests"
    print(f"demo: {domain} traffic {length} (greedy, {max_tokens} tokens, at most {max_seconds:.0f}s); "
          "watch the mean acceptance length and the drafter version:", flush=True)
    report = TrafficReport()

    def due() -> bool:
        if seconds is not None:
            return time.monotonic() - t0 >= seconds
        return len(report.completed) >= requests

    def end_when_due() -> None:  # once due and a round has finished, or at max_seconds
        said = False
        while not stop.wait(1.0) and time.monotonic() - t0 < max_seconds:
            seen = trained()  # asked all along (a registry read a second): it times how long the newest
            # version has served, so the demo does not wait that long again once due
            if not due():
                continue
            if seen:
                break
            if not said:
                print("demo: waiting for a trainer round to finish (and the newest promoted version to serve) ...",
                      flush=True)
                said = True
        stop.set()

    t0 = time.monotonic()
    timer = threading.Thread(target=end_when_due, daemon=True)
    timer.start()
    try:
        report = run_traffic(url, prompts, rate=0, max_tokens=max_tokens, concurrency=1, report_every_s=10.0,
                             stop=stop, on_line=lambda line: print("demo: " + line, flush=True),
                             baseline_every=DEMO_BASELINE_EVERY, report=report)
    finally:
        stop.set()
    return demo_summary(report)


def demo_summary(report: object) -> str:
    """Per drafter version: requests, mean acceptance length, median tokens/s and its ratio to the
    target-only requests served in the same run."""
    from online.traffic.generator import TrafficReport

    done = sorted(report.completed, key=lambda c: c.finished_at)
    if not done:
        raise LivedraftError(f"demo: no request succeeded ({report.failed} failed): {report.errors[:1]}")
    base = [c for c in done if not c.speculate]
    base_tps = TrafficReport.tokens_per_s(base)
    lines = [f"demo: {len(done)} requests in {report.seconds:.0f}s; target alone (every {DEMO_BASELINE_EVERY}th "
             f"request, same server, same run): {base_tps:.1f} tokens/s median over {len(base)} requests",
             "  drafter version | requests | mean acceptance length | tokens/s (median) | x target alone"]
    for v in report.versions():
        cs = [c for c in done if c.speculate and c.drafter_version == v]
        tps = TrafficReport.tokens_per_s(cs)
        lines.append(f"  {v:>15} | {len(cs):8d} | {TrafficReport.mal(cs):22.2f} | {tps:17.1f} | "
                     f"{tps / base_tps if base and base_tps > 0 else float('nan'):.2f}x")
    return "\n".join(lines)
