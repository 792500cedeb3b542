"""The HTTP server on a real port with the story model: completions, SSE, errors, metrics, fairness, drain."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlparse

import pytest
from prometheus_client.parser import text_string_to_metric_families

from online.config import Config
from online.serving.engine import start_serving
from runtime.drafters.factory import load_model_drafter
from runtime.drafters.lookup import PromptLookupDrafter
from runtime.drafters.none import NoDrafter
from runtime.engine import STOP_STRING
from runtime.serve.fairqueue import FairQueue, QueueFull
from runtime.serve.protocol import parse_completion
from runtime.serve.textstream import TextStream
from runtime.sinks import MemorySink
from tests.polling import wait_for
from tests.serving_utils import (
    FakeSource,
    complete,
    hf_greedy,
    random_drafter,
    request,
    run_threads,
    sse_events,
)

PROMPTS = [
    "Once upon a time, there was a dog named",
    "Lily and Tom went to the park. Lily said,",
    "The little bird was sad because",
]
MAX_NEW = 24


def config(**serve) -> Config:
    cfg = Config()
    cfg.serve.port = 0
    for k, v in serve.items():
        setattr(cfg.serve, k, v)
    return cfg


@pytest.fixture(scope="module")
def expected(stories):
    return {p: hf_greedy(stories.model, stories.tokenizer(p).input_ids, MAX_NEW) for p in PROMPTS}


@pytest.fixture(scope="module")
def served(stories):
    source = FakeSource({"v2": lambda: PromptLookupDrafter()})
    sink = MemorySink()
    drafter = load_model_drafter(stories.path, stories, version="v1")  # the target itself: accepts a lot
    # fixed k: a drafter as costly as the target never pays, and adaptive k would (rightly) switch it off
    handle = start_serving(config(poll_s=3600.0, adaptive=False), target=stories, drafter_source=source,
                           initial_drafter=drafter, sink=sink)
    yield handle, source, sink
    assert handle.stop(10.0)


def metric_samples(url: str) -> dict[tuple[str, tuple], float]:
    status, text, headers = request(url, "GET", "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_completion_equals_target_greedy(served, stories, expected):
    handle, _, sink = served
    for prompt, want in expected.items():
        status, body = complete(handle.url, {"prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0})
        assert status == 200, body
        assert body["livedraft"]["output_ids"] == want
        assert body["choices"][0]["text"] == stories.tokenizer.decode(want, skip_special_tokens=True)
        assert body["choices"][0]["finish_reason"] in ("length", "stop")
        n_prompt = len(stories.tokenizer(prompt).input_ids)
        assert body["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": len(want),
                                 "total_tokens": n_prompt + len(want)}
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        stats = body["livedraft"]["stats"]
        assert stats["output_tokens"] == len(want) and stats["mean_acceptance_length"] > 1.5
    assert any(t.output_ids == want for t in sink.events)


def test_a_request_can_ask_for_the_target_alone(served, expected):
    """`"speculate": false` (a livedraft extension): served without a drafter, the same output,
    logged as drafter "none" — a target-only baseline measured beside drafted requests."""
    handle, _, sink = served
    prompt, want = next(iter(expected.items()))
    status, body = complete(handle.url, {"prompt": prompt, "max_tokens": MAX_NEW, "speculate": False})
    assert status == 200, body
    ld = body["livedraft"]
    assert ld["output_ids"] == want and ld["drafter_version"] == "none" and ld["stats"]["drafted"] == 0
    assert ld["stats"]["tokens_per_s"] > 0
    wait_for(lambda: any(t.drafter_version == "none" for t in sink.events), 10, "the target-only trace")


def test_token_id_prompt_and_batch_of_one(served, stories, expected):
    handle = served[0]
    prompt, want = next(iter(expected.items()))
    ids = stories.tokenizer(prompt).input_ids
    for p in (ids, [ids], [prompt]):
        status, body = complete(handle.url, {"prompt": p, "max_tokens": MAX_NEW})
        assert status == 200 and body["livedraft"]["output_ids"] == want


def test_stream_sends_tokens_as_events(served, stories, expected):
    handle = served[0]
    prompt, want = list(expected.items())[1]
    status, text, headers = request(handle.url, "POST", "/v1/completions",
                                    {"prompt": prompt, "max_tokens": MAX_NEW, "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    chunks, final = events[:-2], events[-2]
    assert len(chunks) >= 2  # several steps, one event each
    assert [t for c in chunks for t in c["livedraft"]["token_ids"]] == want
    streamed = "".join(c["choices"][0]["text"] for c in chunks) + final["choices"][0]["text"]
    assert streamed == stories.tokenizer.decode(want, skip_special_tokens=True)
    assert final["choices"][0]["finish_reason"] in ("length", "stop")
    assert final["usage"]["completion_tokens"] == len(want)
    assert final["livedraft"]["output_ids"] == want


def test_stop_string_cuts_text_stream_and_non_stream_alike(served, stories, expected):
    handle, _, sink = served
    prompt, want = list(expected.items())[0]
    full = stories.tokenizer.decode(want, skip_special_tokens=True)
    words = full.split()
    stop = " " + words[len(words) // 3]
    cut = full[: full.index(stop)]
    status, body = complete(handle.url, {"prompt": prompt, "max_tokens": MAX_NEW, "stop": [stop]})
    assert status == 200 and body["choices"][0]["text"] == cut and body["choices"][0]["finish_reason"] == "stop"
    # generation itself ended at the stop string (the step that produced it is kept whole)
    out = body["livedraft"]["output_ids"]
    assert out == want[: len(out)] and len(out) < len(want) and body["usage"]["completion_tokens"] == len(out)
    assert stop in stories.tokenizer.decode(out, skip_special_tokens=True)
    assert [e.finish_reason for e in sink.events if e.request_id == body["id"]] == [STOP_STRING]
    status, text, _ = request(handle.url, "POST", "/v1/completions",
                              {"prompt": prompt, "max_tokens": MAX_NEW, "stop": stop, "stream": True})
    events = sse_events(text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == cut
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_text_stream_never_sends_half_a_character(stories):
    tok = stories.tokenizer
    ids = tok("Hi 😀 there").input_ids[1:]  # byte fallback: the emoji is four tokens
    ts = TextStream(tok, [])
    sent = [ts.push([i]) for i in ids]
    assert all("\ufffd" not in x for x in sent) and "".join(sent) + ts.flush() == "Hi 😀 there"
    cut = TextStream(tok, [])  # generation ended inside the emoji: the complete text, not nothing
    assert cut.push(ids[:5]) + cut.flush() == "Hi " and cut.text == "Hi "


def test_text_stream_holds_back_a_possible_stop_prefix(stories):
    tok = stories.tokenizer
    ids = tok("Once upon a time there was a cat").input_ids[1:]
    ts = TextStream(tok, ["a cat"])
    sent = "".join(ts.push([i]) for i in ids)
    assert "a c" not in sent and ts.stopped
    assert sent + ts.flush() == tok.decode(ids, skip_special_tokens=True).split("a cat")[0]


BAD_BODIES = [
    ({}, "missing field 'prompt'"),
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": []}, "prompt is empty"),
    ({"prompt": 7}, "prompt must be"),
    ({"prompt": ["a", "b"]}, "one prompt per request"),
    ({"prompt": [1, 2, 600]}, "outside the vocabulary"),
    ({"prompt": [1] * 500, "max_tokens": 20}, "context window is 512"),
    ({"prompt": "Hi", "max_tokens": 0}, "max_tokens must be >= 1"),
    ({"prompt": "Hi", "max_tokens": "10"}, "max_tokens must be an integer"),
    ({"prompt": "Hi", "max_tokens": True}, "max_tokens must be an integer"),
    ({"prompt": "Hi", "max_tokens": 2.5}, "max_tokens must be an integer"),
    ({"prompt": "Hi", "temperature": -1}, "temperature must be >= 0"),
    ({"prompt": "Hi", "temperature": 101}, "temperature must be <= 100"),
    ({"prompt": "Hi", "temperature": "hot"}, "temperature must be a number"),
    ({"prompt": "Hi", "top_p": 0}, "top_p must be > 0"),
    ({"prompt": "Hi", "top_p": 1.5}, "top_p must be <= 1"),
    ({"prompt": "Hi", "seed": 1.5}, "seed must be an integer"),
    ({"prompt": "Hi", "stream": "yes"}, "stream must be true or false"),
    ({"prompt": "Hi", "stop": [""]}, "stop must be"),
    ({"prompt": "Hi", "n": 2}, "n=2 is not supported"),
    ({"prompt": "Hi", "metadata": {"tag": 3}}, "tag"),
    ({"prompt": "Hi", "speculate": "no"}, "speculate must be true or false"),
    ([1, 2], "must be a JSON object"),
]


@pytest.mark.parametrize("body,message", BAD_BODIES)
def test_bad_requests_get_400_with_a_message(served, body, message):
    status, payload = complete(served[0].url, body)
    assert status == 400, payload
    assert message in payload["error"]["message"] and payload["error"]["type"] == "invalid_request_error"


def test_malformed_http_never_hurts_the_server(served, expected):
    url = served[0].url
    status, payload, _ = request(url, "POST", "/v1/completions", raw=b"{not json")
    assert status == 400 and "not valid JSON" in payload["error"]["message"]
    status, payload, _ = request(url, "POST", "/v1/completions", raw=b"\xff\xfe")
    assert status == 400
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Length", str(2 << 20))  # announced, never sent: the server must not wait for it
    conn.endheaders(b"{}")
    resp = conn.getresponse()
    assert resp.status == 413 and "limit" in json.loads(resp.read())["error"]["message"]
    conn.close()
    assert request(url, "GET", "/nope")[0] == 404
    assert request(url, "POST", "/v1/chat", {"prompt": "x"})[0] == 404
    status, body, _ = request(url, "GET", "/healthz")
    assert status == 200 and body["status"] == "ok"
    prompt, want = next(iter(expected.items()))
    assert complete(url, {"prompt": prompt, "max_tokens": MAX_NEW})[1]["livedraft"]["output_ids"] == want


def test_metrics_parse_and_move(served, expected):
    url = served[0].url
    before = metric_samples(url)
    prompt, want = next(iter(expected.items()))
    assert complete(url, {"prompt": prompt, "max_tokens": MAX_NEW})[0] == 200
    assert complete(url, {"prompt": ""})[0] == 400
    after = metric_samples(url)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("livedraft_requests_total", status="ok") == 1
    assert delta("livedraft_requests_total", status="bad_request") == 1
    version = next(dict(k[1])["version"] for k in after if k[0] == "livedraft_drafter_info")
    assert delta("livedraft_generation_tokens_total", version=version) == len(want)
    # the same prompt again keeps all of its KV but the last token's (prefix reuse)
    mid = metric_samples(url)
    assert complete(url, {"prompt": prompt, "max_tokens": MAX_NEW})[0] == 200
    reused = metric_samples(url).get(("livedraft_prompt_tokens_reused_total", (("version", version),)), 0.0) - \
        mid.get(("livedraft_prompt_tokens_reused_total", (("version", version),)), 0.0)
    prompt_len = metric_samples(url)[("livedraft_prompt_tokens_total", (("version", version),))] - \
        mid[("livedraft_prompt_tokens_total", (("version", version),))]
    assert reused == prompt_len - 1
    assert delta("livedraft_spec_decode_num_drafts_total", version=version) >= 1
    assert delta("livedraft_spec_decode_num_accepted_tokens_total", version=version) >= 1
    assert after[("livedraft_request_seconds_count", ())] - before.get(("livedraft_request_seconds_count", ()), 0) == 1
    assert after[("livedraft_spec_decode_mean_acceptance_length", (("version", version),))] > 1.0
    assert ("livedraft_spec_decode_per_position_acceptance", (("position", "0"), ("version", version))) in after
    for name in ("livedraft_drafter_swaps_total", "livedraft_drafter_rollbacks_total",
                 "livedraft_drafter_swap_pause_seconds_max", "livedraft_events_dropped_total",
                 "livedraft_draft_seconds_total", "livedraft_verify_seconds_total", "livedraft_queue_depth"):
        assert any(k[0] == name for k in after), name


def test_drafter_endpoint_follows_a_swap(served, expected):
    handle, source, _ = served
    status, before, _ = request(handle.url, "GET", "/v1/drafter")
    assert status == 200 and before["hot_swap"] is True and before["version"] == "v1"
    source.wanted = "v2"
    assert handle.swapper.poll_once().kind == "swap"
    status, after, _ = request(handle.url, "GET", "/v1/drafter")
    assert after["version"] == "v2" and after["swaps"] == before["swaps"] + 1
    assert after["history"][-1]["kind"] == "swap" and after["history"][-1]["to_version"] == "v2"
    prompt, want = next(iter(expected.items()))
    status, body = complete(handle.url, {"prompt": prompt, "max_tokens": MAX_NEW})
    assert body["livedraft"]["drafter_version"] == "v2" and body["livedraft"]["output_ids"] == want
    metrics = metric_samples(handle.url)
    assert metrics[("livedraft_drafter_info", (("version", "v2"),))] == 1
    assert metrics[("livedraft_drafter_swaps_total", ())] >= 1


def test_tag_from_header_metadata_or_user(served, stories):
    handle, _, sink = served
    for body, headers, tag in (({"user": "u1"}, {}, "u1"), ({"metadata": {"tag": "m1"}, "user": "u"}, {}, "m1"),
                               ({"user": "u"}, {"X-Livedraft-Tag": "h1"}, "h1")):
        status, out = complete(handle.url, {"prompt": "Once", "max_tokens": 4, **body}, headers)
        assert status == 200
        rid = out["id"]
        assert [t.tag for t in sink.events if t.request_id == rid] == [tag]


def test_concurrent_clients_all_exact(served, expected):
    url = served[0].url
    items = list(expected.items())

    def client(i: int) -> None:
        for j in range(3):
            prompt, want = items[(i + j) % len(items)]
            status, body = complete(url, {"prompt": prompt, "max_tokens": MAX_NEW}, {"X-Client-Id": f"c{i}"})
            assert status == 200 and body["livedraft"]["output_ids"] == want

    assert run_threads(4, client) == []


def test_seeded_sampling_is_reproducible(served):
    url = served[0].url
    body = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "seed": 7}
    first, second = complete(url, body), complete(url, body)
    assert first[0] == second[0] == 200
    assert first[1]["livedraft"]["output_ids"] == second[1]["livedraft"]["output_ids"]
    other = complete(url, {**body, "seed": 8})[1]["livedraft"]["output_ids"]
    assert other != first[1]["livedraft"]["output_ids"]  # the seed really reaches the sampler


def test_collapse_rolls_back_through_the_server(stories, expected):
    source = FakeSource({"bad": lambda: random_drafter(stories, stories.path)})
    # fixed k: the good drafter (the target itself) drafts every step; the cost rule would turn it off, as it
    # costs what the target does, and a version that drafts little has no acceptance to collapse from
    cfg = config(poll_s=3600.0, rollback_window=4, rollback_min_requests=3, rollback_max_drop=0.5, adaptive=False)
    handle = start_serving(cfg, target=stories, drafter_source=source, sink=MemorySink(),
                           initial_drafter=load_model_drafter(stories.path, stories, version="good"))
    prompts = list(expected)
    try:
        for i in range(3):
            assert complete(handle.url, {"prompt": prompts[i % 3], "max_tokens": MAX_NEW})[0] == 200
        source.wanted = "bad"
        assert handle.swapper.poll_once().kind == "swap"
        served_by = []
        for i in range(4):
            status, body = complete(handle.url, {"prompt": prompts[i % 3], "max_tokens": MAX_NEW})
            assert status == 200 and body["livedraft"]["output_ids"] == expected[prompts[i % 3]]
            served_by.append(body["livedraft"]["drafter_version"])
        assert served_by == ["bad", "bad", "bad", "good"]  # judged after 3 requests, rolled back at once
        handle.swapper.flush()
        (version, reason, numbers), = source.rollbacks
        assert version == "bad" and numbers["new_mean_acceptance_length"] < numbers["previous_mean_acceptance_length"]
        status, drafter, _ = request(handle.url, "GET", "/v1/drafter")
        assert drafter["version"] == "good" and drafter["rollbacks"] == 1
        assert drafter["history"][-1]["kind"] == "rollback" and "collapsed" in drafter["history"][-1]["detail"]
        assert metric_samples(handle.url)[("livedraft_drafter_rollbacks_total", ())] == 1
    finally:
        assert handle.stop(10.0)


def test_client_leaving_a_stream_cancels_it(stories):
    sink = MemorySink()
    handle = start_serving(config(), target=stories, initial_drafter=PromptLookupDrafter(), sink=sink)
    try:
        u = urlparse(handle.url)
        body = json.dumps({"prompt": [1] * 8, "max_tokens": 500, "stream": True}).encode()
        with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            got = b""
            while b"data: " not in got:
                got += sock.recv(4096)
            assert got.startswith(b"HTTP/1.1 200")
        # the client is gone after its first event
        wait_for(lambda: metric_samples(handle.url).get(("livedraft_requests_total", (("status", "cancelled"),))) == 1,
                 30, "the cancelled request in /metrics")
        assert sink.events == []  # generation stopped: no trace of a request nobody received
        prompt = "Once upon a time"
        status, body = complete(handle.url, {"prompt": prompt, "max_tokens": 8})
        assert status == 200
        assert body["livedraft"]["output_ids"] == hf_greedy(stories.model, stories.tokenizer(prompt).input_ids, 8)
    finally:
        assert handle.stop(10.0)


class BlockingDrafter(NoDrafter):
    """Holds the engine worker in `begin` until released, so the queue state is deterministic."""

    def __init__(self) -> None:
        self.started = threading.Semaphore(0)
        self.release = threading.Event()

    def begin(self, req_id: str, prompt_ids: list[int], *, tag: str | None = None) -> None:
        self.started.release()
        assert self.release.wait(30)


def test_queue_limits_answer_429_and_503_then_drain(stories):
    drafter = BlockingDrafter()
    sink = MemorySink()
    # X-Client-Id names the client only when the operator trusts it (a proxy sets it)
    handle = start_serving(config(max_queue=2, max_queue_per_client=1, trust_client_id=True), target=stories,
                           initial_drafter=drafter, sink=sink)
    results: dict[str, tuple[int, dict]] = {}

    def send(name: str, client: str) -> threading.Thread:
        def go() -> None:
            results[name] = complete(handle.url, {"prompt": "Once upon", "max_tokens": 4}, {"X-Client-Id": client})
        t = threading.Thread(target=go)
        t.start()
        return t

    try:
        running = send("running", "a")
        assert drafter.started.acquire(timeout=30)  # the worker is busy with it
        queued_a = send("queued_a", "a")
        wait_for(lambda: len(handle.server.queue) == 1, 30, "one queued request")
        send("a_again", "a").join(30)
        assert results["a_again"][0] == 429 and "already has 1" in results["a_again"][1]["error"]["message"]
        queued_b = send("queued_b", "b")
        wait_for(lambda: len(handle.server.queue) == 2, 30, "two queued requests")
        send("c", "c").join(30)
        assert results["c"][0] == 503 and "queue is full" in results["c"][1]["error"]["message"]
        stopper = threading.Thread(target=lambda: results.setdefault("drained", handle.stop(30)))
        stopper.start()
        wait_for(lambda: request(handle.url, "GET", "/healthz")[0] == 503, 30, "/healthz to say 503")
        send("late", "d").join(30)
        assert results["late"][0] == 503 and "shutting down" in results["late"][1]["error"]["message"]
        drafter.release.set()
        for t in (running, queued_a, queued_b, stopper):
            t.join(30)
        assert results["drained"] is True
        assert [results[k][0] for k in ("running", "queued_a", "queued_b")] == [200, 200, 200]
        assert len(sink.events) == 3  # every served request reached the sink before stop returned
    finally:
        drafter.release.set()
        handle.stop(5)


def test_fair_queue_round_robin_and_limits():
    q: FairQueue[str] = FairQueue(max_size=6, max_per_client=3)
    for item in ("a1", "a2", "a3"):
        q.put("a", item)
    q.put("b", "b1")
    q.put("c", "c1")
    q.put("b", "b2")
    with pytest.raises(QueueFull) as e:
        q.put("a", "a4")
    assert e.value.status == 429
    with pytest.raises(QueueFull) as e:
        q.put("d", "d1")
    assert e.value.status == 503
    assert [q.get(0) for _ in range(6)] == ["a1", "b1", "c1", "a2", "b2", "a3"]
    assert q.get(timeout_s=0.01) is None
    q.put("a", "x")
    q.close()
    with pytest.raises(QueueFull):
        q.put("a", "y")
    assert q.get() == "x" and q.get() is None  # closed: drains, then returns at once


def test_parse_completion_defaults(stories):
    req = parse_completion({"prompt": "Hi", "model": "anything", "logprobs": None},
                           encode=lambda t: stories.tokenizer(t).input_ids, default_max_tokens=7)
    assert req.params.max_new_tokens == 7 and req.params.temperature == 0.0 and req.params.top_p == 1.0
    assert req.stream is False and req.stop == [] and req.tag is None


def test_serve_cli_drains_on_sigterm(stories, tmp_path):
    env = {**os.environ, "LIVEDRAFT_DATA_DIR": str(tmp_path), "LIVEDRAFT_STREAM__KIND": "memory",
           "LIVEDRAFT_SERVE__TORCH_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "online.cli", "serve", "--target", str(stories.path), "--drafter-kind", "lookup",
         "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        m = re.search(r"on (http://[\d.]+:\d+)", line)
        assert m, f"no URL in {line!r}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
        url = m.group(1)
        status, body = complete(url, {"prompt": "Once upon a time", "max_tokens": 8})
        assert status == 200 and body["usage"]["completion_tokens"] == 8
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        assert "stopped (drained)" in out
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_cli_bad_input_exits_2(tmp_path, capsys, monkeypatch):
    from online.cli import main

    monkeypatch.setenv("LIVEDRAFT_DATA_DIR", str(tmp_path))
    assert main(["serve", "--target", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "livedraft serve: error:" in err and "not found" in err and "Traceback" not in err


def test_serve_suffix_drafts_from_the_traffic_already_in_the_stream(stories, tmp_path):
    """`serve --drafter-kind suffix` reads the daemon's traffic cache (snapshot + stream tail), not
    an empty tree: an output logged before it started is drafted on its first request."""
    from online.config import Config
    from online.stream import open_sink
    from runtime.trace import RequestTrace

    prompt = "Once upon a time, there was a dog named"
    ids = stories.tokenizer(prompt).input_ids
    out = hf_greedy(stories.model, ids, 32)
    cfg = Config()
    cfg.data_dir = str(tmp_path)
    sink = open_sink(cfg)
    sink.emit(RequestTrace(request_id="logged-1", prompt_ids=ids, output_ids=out, steps=[], target_model="t",
                           drafter_version="-", max_new_tokens=32, finish_reason="length"))
    sink.close(10)
    env = {**os.environ, "LIVEDRAFT_DATA_DIR": str(tmp_path), "LIVEDRAFT_SERVE__TORCH_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "online.cli", "serve", "--target", str(stories.path), "--drafter-kind", "suffix",
         "--k", "8", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        m = re.search(r"on (http://[\d.]+:\d+)", line)
        assert m, f"no URL in {line!r}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}"
        status, body = complete(m.group(1), {"prompt": prompt, "max_tokens": 32})
        assert status == 200 and body["livedraft"]["output_ids"] == out
        # measured: ~7 (the logged output drafted whole); an empty tree drafts nothing on a first request
        assert body["livedraft"]["stats"]["mean_acceptance_length"] > 4
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
