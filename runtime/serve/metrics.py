"""Prometheus metrics for the server (vLLM's naming and conventions, prefixed `livedraft_`).

Acceptance is exported as raw counters, labelled by drafter version, so any
window can be computed in PromQL, plus cumulative gauges for a quick look:

    mean acceptance length (5 min):
      1 + rate(livedraft_spec_decode_num_accepted_tokens_total[5m])
        / rate(livedraft_spec_decode_num_drafts_total[5m])
    draft acceptance rate:
      rate(livedraft_spec_decode_num_accepted_tokens_total[5m])
        / rate(livedraft_spec_decode_num_draft_tokens_total[5m])
    per-position acceptance (position p):
      rate(livedraft_spec_decode_num_accepted_tokens_per_pos_total{position="p"}[5m])
        / on(version) rate(livedraft_spec_decode_num_drafts_total[5m])

Values that live elsewhere (swap counters, sink drops, queue depth) are read at
scrape time from callables, so nothing has to push them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from runtime.sinks import EventSink
from runtime.stats import RequestStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
REQUEST_STATUSES = ("ok", "bad_request", "rejected", "cancelled", "error")


class ServerMetrics:
    """Thread-safe aggregate of finished requests plus live state, rendered on scrape.

    `version` returns the serving drafter version; `swapper_status` a HotSwapper
    status dict (or None without hot-swap); `sink` is the event sink (its
    `emitted` / `dropped` / `failed` counters are exported); `queue_depth` the
    number of waiting requests, `running` the rows the engine decodes now,
    `dead_letters` (when a collector runs in this process, `livedraft up`) its count.
    """

    def __init__(
        self,
        *,
        version: Callable[[], str],
        swapper_status: Callable[[], dict[str, Any] | None] = lambda: None,
        sink: EventSink | None = None,
        queue_depth: Callable[[], int] = lambda: 0,
        running: Callable[[], int] = lambda: 0,
        dead_letters: Callable[[], int] | None = None,
    ) -> None:
        self._version, self._swapper_status, self._sink, self._queue_depth = version, swapper_status, sink, queue_depth
        self._running, self._dead_letters = running, dead_letters
        self._lock = threading.Lock()
        self._requests = dict.fromkeys(REQUEST_STATUSES, 0)
        self._by_version: dict[str, RequestStats] = {}
        self.registry = CollectorRegistry(auto_describe=True)
        self.latency = Histogram(
            "livedraft_request_seconds", "Time from queueing to the last token, per successful request.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=self.registry)
        self.registry.register(self)

    def record_request(self, status: str) -> None:
        """Counts one answered request by outcome (one of REQUEST_STATUSES)."""
        with self._lock:
            self._requests[status] += 1

    def record_result(self, version: str, stats: RequestStats, latency_s: float) -> None:
        """Adds one finished generation's tokens, acceptance and timings."""
        with self._lock:
            prev = self._by_version.get(version)
            self._by_version[version] = stats if prev is None else prev.merge(stats)
        self.latency.observe(latency_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:  # prometheus_client Collector protocol
        with self._lock:
            requests = dict(self._requests)
            by_version = dict(self._by_version)
        c = CounterMetricFamily("livedraft_requests", "Completion requests answered, by outcome.", labels=["status"])
        for status, n in requests.items():
            c.add_metric([status], n)
        yield c
        yield from _acceptance(by_version)
        info = InfoMetricFamily("livedraft_drafter", "The drafter version new requests use.")
        info.add_metric([], {"version": str(self._version())})
        yield info
        yield from _swaps(self._swapper_status())
        for attr, doc in (("emitted", "Trace events handed to the sink (one per finished request)."),
                          ("dropped", "Trace events lost because the sink's queue was full "
                                      "(or still queued at close)."),
                          ("failed", "Trace events the sink's transport failed to write.")):
            yield CounterMetricFamily(f"livedraft_events_{attr}", doc,
                                      value=getattr(self._sink, attr) if self._sink is not None else 0)
        if self._dead_letters is not None:
            yield CounterMetricFamily("livedraft_events_dead_lettered",
                                      "Stream records this process's collector could not decode "
                                      "(kept as dead letters).",
                                      value=self._dead_letters())
        yield GaugeMetricFamily("livedraft_queue_depth", "Requests waiting for the engine.", value=self._queue_depth())
        yield GaugeMetricFamily("livedraft_running_requests", "Requests the engine decodes together now (batch rows).",
                                value=self._running())


def _acceptance(by_version: dict[str, RequestStats]) -> Iterator[Metric]:
    v = ["version"]
    fam = {
        "prompt": CounterMetricFamily("livedraft_prompt_tokens", "Prompt tokens of finished requests.", labels=v),
        "reused": CounterMetricFamily("livedraft_prompt_tokens_reused",
                                      "Prompt tokens whose KV cache was reused from a row's earlier request "
                                      "(prefix reuse: no forward).", labels=v),
        "gen": CounterMetricFamily("livedraft_generation_tokens", "Generated tokens of finished requests.", labels=v),
        "drafts": CounterMetricFamily("livedraft_spec_decode_num_drafts",
                                      "Verify steps (each counts, also one with an empty draft).", labels=v),
        "drafted": CounterMetricFamily("livedraft_spec_decode_num_draft_tokens", "Draft tokens proposed.", labels=v),
        "accepted": CounterMetricFamily("livedraft_spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                        labels=v),
        "pos": CounterMetricFamily("livedraft_spec_decode_num_accepted_tokens_per_pos",
                                   "Accepted draft tokens by position in the draft.", labels=v + ["position"]),
        "mal": GaugeMetricFamily("livedraft_spec_decode_mean_acceptance_length",
                                 "1 + accepted / verify steps since start (counts the bonus token).", labels=v),
        "rate": GaugeMetricFamily("livedraft_spec_decode_draft_acceptance_rate",
                                  "Accepted / drafted tokens since start.", labels=v),
        "pos_rate": GaugeMetricFamily("livedraft_spec_decode_per_position_acceptance",
                                      "Verify steps whose draft token at `position` was accepted / verify steps.",
                                      labels=v + ["position"]),
        "served": CounterMetricFamily("livedraft_requests_served", "Finished requests, by the drafter version "
                                      "that served them.", labels=v),
        "prefill_s": CounterMetricFamily("livedraft_prefill_seconds", "Time spent in prefill.", labels=v),
        "draft_s": CounterMetricFamily("livedraft_draft_seconds", "Time spent drafting.", labels=v),
        "verify_s": CounterMetricFamily("livedraft_verify_seconds", "Time spent verifying.", labels=v),
    }
    for version, s in sorted(by_version.items()):
        lv = [version]
        fam["served"].add_metric(lv, s.requests)
        fam["prompt"].add_metric(lv, s.prompt_tokens)
        fam["reused"].add_metric(lv, s.reused_prompt_tokens)
        fam["gen"].add_metric(lv, s.output_tokens)
        fam["drafts"].add_metric(lv, s.steps)
        fam["drafted"].add_metric(lv, s.drafted)
        fam["accepted"].add_metric(lv, s.accepted)
        for i, (n, rate) in enumerate(zip(s.accepted_per_position, s.per_position_acceptance, strict=True)):
            fam["pos"].add_metric(lv + [str(i)], n)
            fam["pos_rate"].add_metric(lv + [str(i)], rate)
        fam["mal"].add_metric(lv, s.mean_acceptance_length)
        fam["rate"].add_metric(lv, s.acceptance_rate)
        fam["prefill_s"].add_metric(lv, s.prefill_s)
        fam["draft_s"].add_metric(lv, s.draft_s)
        fam["verify_s"].add_metric(lv, s.verify_s)
    yield from fam.values()


def _swaps(status: dict[str, Any] | None) -> Iterator[Metric]:
    status = status or {}
    yield CounterMetricFamily("livedraft_drafter_swaps", "Drafter hot-swaps.", value=status.get("swaps", 0))
    yield CounterMetricFamily("livedraft_drafter_rollbacks", "Automatic rollbacks after an acceptance collapse.",
                              value=status.get("rollbacks", 0))
    yield CounterMetricFamily("livedraft_drafter_load_failures",
                              "Drafter version loads that failed (a version tried again counts each time).",
                              value=status.get("load_failures", 0))
    yield GaugeMetricFamily("livedraft_drafter_swap_pause_seconds_last",
                            "How long the last swap held the drafter slot.", value=status.get("last_swap_pause_s", 0.0))
    yield GaugeMetricFamily("livedraft_drafter_swap_pause_seconds_max",
                            "Longest time a swap held the drafter slot.", value=status.get("max_swap_pause_s", 0.0))
    yield GaugeMetricFamily("livedraft_drafter_swap_load_seconds_last",
                            "How long the last swap's version took to load before it served (llama-server: "
                            "its process start to healthy).", value=status.get("last_swap_load_s", 0.0))
