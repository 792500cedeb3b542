"""`up --demo`'s traffic: it runs until a number of requests is answered (so the loop sees the same
traffic on a slow machine as on a fast one), waits for the first trainer round when that is not
done yet, stops at its cap whatever happens, and closes with the per-version table."""

from __future__ import annotations

import re
import threading
import time

import pytest

from online.traffic import demo, generator


@pytest.fixture
def fake_server(monkeypatch):
    """`complete` answers at once: drafter version "1" for speculative requests, 8 tokens."""
    served: list[bool] = []

    def complete(url, prompt, *, max_tokens, speculate=True, **kw):
        served.append(speculate)
        time.sleep(0.01)
        return {"livedraft": {"drafter_version": "1" if speculate else "none", "output_ids": list(range(8)),
                              "stats": {"steps": 6 if speculate else 8, "accepted": 2 if speculate else 0,
                                        "tokens_per_s": 20.0 if speculate else 16.0}}}

    monkeypatch.setattr(generator, "complete", complete)
    return served


def run(trained, **kw) -> tuple[str, float]:
    t0 = time.monotonic()
    args = {"requests": 12, "seconds": None, "max_seconds": 20.0} | kw
    table = demo.run_demo("http://fake", ["p"] * 10_000, stop=threading.Event(), trained=trained, max_tokens=8,
                          domain="stories", **args)
    return table, time.monotonic() - t0


def answered(table: str) -> int:
    return int(re.search(r"demo: (\d+) requests in", table).group(1))


def test_the_demo_ends_once_its_requests_are_answered_and_a_round_has_finished(fake_server):
    table, secs = run(lambda: True)
    assert 12 <= answered(table) < 200 and secs < 10
    assert re.search(r"\n\s+1 \|\s+\d+ \|\s+1\.33 \|\s+20\.0 \| 1\.25x", table)  # 20 tok/s vs 16 alone
    assert fake_server.count(False) == answered(table) // demo.DEMO_BASELINE_EVERY


def test_the_demo_waits_for_the_first_round_then_stops_at_its_cap(fake_server, capsys):
    done_at = time.monotonic() + 2.0
    table, secs = run(lambda: time.monotonic() >= done_at)
    assert secs >= 2.0 and "waiting for a trainer round to finish" in capsys.readouterr().out
    assert answered(table) > 12
    table, secs = run(lambda: False, max_seconds=1.5)  # a round that never finishes: the cap ends it
    assert 1.5 <= secs < 6


def test_the_demo_can_run_for_a_time_instead(fake_server):
    table, secs = run(lambda: True, requests=1, seconds=1.5)
    assert 1.5 <= secs < 6 and answered(table) > 1
