"""Traffic generator: domain pools, rate pacing, acceptance bookkeeping from the responses' `livedraft`
block (against a stub server), and a clear CLI error when no server answers."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from devkit.kafka_broker import free_port
from online.cli import main
from online.traffic.generator import TrafficReport, chat_wrap, run_traffic
from online.traffic.prompts import DOMAINS, prompts_for


def test_domain_pools_are_large_distinct_and_deterministic():
    for name, pool in DOMAINS.items():
        assert len(pool) >= 30 and len(set(pool)) == len(pool), name
    assert not set(DOMAINS["stories"]) & set(DOMAINS["code"])
    assert prompts_for("code", 20, seed=3) == prompts_for("code", 20, seed=3) != prompts_for("code", 20, seed=4)
    with pytest.raises(ValueError, match="unknown traffic domain 'poetry'"):
        prompts_for("poetry", 1)
    assert chat_wrap(["hi"]) == ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"]


class Stub(BaseHTTPRequestHandler):
    """Answers like runtime/serve/server.py: the first 4 requests by version "1" (4 accepted in 4 steps: mean
    acceptance length 2), the rest by "2" (12 in 4: 4)."""

    calls: list = []

    def do_POST(self):  # noqa: N802 - http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Stub.calls.append((time.monotonic(), body))
        n = len(Stub.calls)
        version, accepted = ("1", 4) if n <= 4 else ("2", 12)
        reply = {"choices": [{"text": "x"}], "livedraft": {"drafter_version": version, "output_ids": [n],
                                                             "stats": {"steps": 4, "accepted": accepted}}}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_run_traffic_paces_requests_and_reports_acceptance_per_version():
    Stub.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    lines = []
    try:
        report = run_traffic(f"http://127.0.0.1:{server.server_port}", ["a", "b"] * 4, rate=20.0, max_tokens=5,
                             tag="stories", concurrency=3, report_every_s=0.1, on_line=lines.append)
    finally:
        server.shutdown()
    assert report.failed == 0 and len(report.completed) == 8
    starts = sorted(t for t, _ in Stub.calls)
    assert starts[-1] - starts[0] >= 7 / 20 - 0.02  # open-loop pacing: request i at i / rate
    assert Stub.calls[0][1] == {"prompt": "a", "max_tokens": 5, "temperature": 0.0, "metadata": {"tag": "stories"}}
    assert report.versions() == ["1", "2"]
    assert TrafficReport.mal([c for c in report.completed if c.drafter_version == "1"]) == pytest.approx(2.0)
    assert TrafficReport.mal(report.completed) == pytest.approx(1 + 64 / 32)
    assert "8 done, 0 failed" in lines[-1] and "drafter 2" in lines[-1]


def test_traffic_cli_says_when_no_server_answers(capsys):
    port = free_port()  # closed again on return: nothing listens there
    code = main(["traffic", "--url", f"http://127.0.0.1:{port}", "--requests", "2", "--rate", "0"])
    err = capsys.readouterr().err
    assert code == 2
    assert "no request succeeded (2 failed)" in err and "cannot reach" in err


def test_traffic_cli_replays_your_own_prompts_with_a_baseline_and_a_key(tmp_path, capsys):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "first"}\n{"prompt": "second"}\n')
    Stub.calls = []
    seen_auth = []

    class Keyed(Stub):
        def do_POST(self):  # noqa: N802
            seen_auth.append(self.headers.get("Authorization"))
            super().do_POST()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Keyed)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        code = main(["traffic", "--url", f"http://127.0.0.1:{server.server_port}", "--prompts", str(f),
                     "--requests", "4", "--rate", "0", "--concurrency", "1", "--baseline-every", "2",
                     "--api-key", "sk-test-123"])
    finally:
        server.shutdown()
    assert code == 0
    bodies = [b for _, b in Stub.calls]
    assert [b["prompt"] for b in bodies] == ["first", "second", "first", "second"]
    assert [b.get("speculate", True) for b in bodies] == [True, False, True, False]
    assert all("metadata" not in b for b in bodies)  # your prompts carry no built-in domain tag
    assert seen_auth == ["Bearer sk-test-123"] * 4
    assert "prompts from" in capsys.readouterr().out
