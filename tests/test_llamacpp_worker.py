"""LlamaServerWorker's failure paths, against fake upstreams (no llama-server binary needed): a
target-only upstream that cannot start, a swap between picking an upstream and entering it, stop
strings and llama-server's counts, events that are not JSON, and restarts that honour
[engine] start_timeout_s. The real binary's behaviour is in tests/test_llama_server.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.engine import STOP_STRING, SamplingParams
from runtime.llamacpp.upstream import LaunchSpec, SpecParams, Upstream, UpstreamError
from runtime.llamacpp.worker import LlamaServerWorker
from runtime.serve.fairqueue import FairQueue
from runtime.serve.worker import CompletionRequest
from runtime.slot import DrafterSlot

HEAD = LaunchSpec(binary=Path("/nonexistent/llama-server"), model=Path("t.gguf"), head=Path("h.gguf"),
                  spec=SpecParams(4, 0.0))


class FakeConn:
    def close(self) -> None:
        pass


class FakeUpstream(Upstream):
    """An Upstream whose process is always up and whose /completion stream is `events` (each a
    JSON-ready dict, or raw bytes sent as is); the request bodies it got are in `bodies`."""

    def __init__(self, version: str, events: list | None = None, launch: LaunchSpec = HEAD) -> None:
        super().__init__(launch, version=version)
        self.events = events if events is not None else [{"tokens": [5], "stop": True, "stop_type": "limit"}]
        self.bodies: list[dict] = []

    @property
    def alive(self) -> bool:
        return True

    def open_stream(self, body: dict, timeout_s: float):
        self.bodies.append(body)
        lines = [e if isinstance(e, bytes) else f"data: {json.dumps(e)}\n".encode() for e in self.events]
        return FakeConn(), iter(lines)


class StopAt:
    """A text stream that stops at token 99 (what the server's TextStream does at a stop string)."""

    def __init__(self) -> None:
        self.stopped = False

    def push(self, ids: list[int]) -> str:
        self.stopped = self.stopped or 99 in ids
        return "x" * len(ids)


def _worker(slot: DrafterSlot, **kw) -> LlamaServerWorker:
    w = LlamaServerWorker(slot, FairQueue(16, 16), target_model="t", max_batch=2, wait_s=0.3, **kw)
    w.attach(text_stream=lambda job: StopAt(), on_result=lambda job: None)
    w.start()
    return w


def _run(w: LlamaServerWorker, *, speculate: bool = True, stop: list[str] | None = None):
    job = w.submit(CompletionRequest([1, 2, 3], SamplingParams(8, 0.0, 1.0, None), stop=stop or [],
                                     speculate=speculate), "client")
    assert job.done.wait(10), "the request never finished"
    return job


def _stop(w: LlamaServerWorker) -> None:
    w.close()
    w.join(2)


def test_a_target_only_upstream_that_cannot_start_fails_its_requests_and_frees_their_places():
    """Before: the failure escaped the request's thread, so the client waited for its timeout and
    the request's place was never given back (after `parallel` such requests nothing was served)."""
    starts = []

    def baseline() -> Upstream:
        starts.append(1)
        raise UpstreamError("llama-server exited with code 1 while starting: out of memory")

    w = _worker(DrafterSlot(FakeUpstream("3")), baseline=baseline)
    try:
        for _ in range(3):  # more than max_batch: the places come back
            job = _run(w, speculate=False)
            assert job.error is not None and job.error[0] == 503
            assert "out of memory" in job.error[2]
        assert len(starts) == 1  # within wait_s of a failed start the others fail fast, without a start
        assert w.running == 0
        assert _run(w).result is not None  # the drafting upstream still serves
    finally:
        _stop(w)


def test_a_request_never_rides_an_upstream_a_swap_is_retiring():
    """A swap between a request's `slot.get()` and its `enter()` retires what it got: the request
    goes to the upstream that replaced it instead of waiting on a stopping process."""
    old, new = FakeUpstream("3"), FakeUpstream("4")
    slot = DrafterSlot(new)
    handed = [old]

    class Racing(DrafterSlot):
        def get(self):
            return handed.pop() if handed else slot.get()

    old._retired = True  # retire() sets this before it drains
    w = _worker(Racing(new))
    try:
        job = _run(w)
        assert job.error is None and job.result.trace.drafter_version == "4"
        assert old.bodies == [] and len(new.bodies) == 1
        assert old._inflight.count == 0 and new._inflight.count == 0
    finally:
        _stop(w)


def test_a_stop_string_ends_the_answer_and_keeps_llama_servers_draft_counts():
    """llama-server is told the stop strings, so its final message (drafted / accepted counts, the
    prompt's timing) comes right after the answer ends there; before, the connection was closed at
    the stop and the trace said nothing was drafted."""
    final = {"tokens": [], "stop": True, "stop_type": "word",
             "timings": {"draft_n": 6, "draft_n_accepted": 2, "prompt_n": 3, "prompt_ms": 4.0}}
    up = FakeUpstream("3", [{"tokens": [7, 8]}, {"tokens": [99]}, {"tokens": []}, final])
    w = _worker(DrafterSlot(up))
    try:
        job = _run(w, stop=["END"])
        assert up.bodies[0]["stop"] == ["END"]
        r = job.result
        assert r.trace.output_ids == [7, 8, 99] and r.trace.finish_reason == STOP_STRING
        assert (r.trace.counts.drafted, r.trace.counts.accepted, r.trace.counts.steps) == (6, 2, 1)
        assert r.stats.prefill_s == pytest.approx(0.004)
    finally:
        _stop(w)


def test_past_a_stop_string_llama_server_does_not_match_the_answer_ends_after_a_few_chunks():
    never = FakeUpstream("3", [{"tokens": [7]}, {"tokens": [99]}] + [{"tokens": [1]}] * 1000)
    w = _worker(DrafterSlot(never))
    try:
        job = _run(w, stop=["END"])
        assert job.result.trace.output_ids == [7, 99] and job.result.trace.finish_reason == STOP_STRING
        assert job.result.trace.counts.drafted == 0  # no final message: nothing known, nothing made up
        assert len(never.bodies) == 1
    finally:
        _stop(w)


def test_an_event_that_is_not_json_is_a_503_naming_llama_server():
    w = _worker(DrafterSlot(FakeUpstream("3", [{"tokens": [7]}, b"data: <html>bad gateway</html>\n"])))
    try:
        job = _run(w)
        assert job.error[0] == 503 and "llama-server sent an event that is not JSON" in job.error[2]
    finally:
        _stop(w)


def test_a_crashed_upstream_is_restarted_with_the_configured_start_timeout(monkeypatch):
    seen = []

    class Dead(FakeUpstream):
        process = object()  # started once, now gone

        @property
        def alive(self) -> bool:
            return False

        def start(self, timeout_s: float = 120.0):
            seen.append(timeout_s)
            return self

    w = LlamaServerWorker(DrafterSlot(FakeUpstream("3")), FairQueue(4, 4), target_model="t", start_timeout_s=600.0)
    dead = Dead("3")
    monkeypatch.setattr(Upstream, "exit_reason", lambda self: "llama-server (drafter 3) exited with code 9")
    w._restart(dead)
    assert seen == [600.0] and w.restarts == 1


def test_the_rule_guard_never_overwrites_a_swap_made_while_it_started_its_replacement(monkeypatch):
    """The guard swaps only if the upstream it judged still serves (DrafterSlot.swap_if): a version
    pushed meanwhile keeps serving and the guard's replacement is stopped."""
    from online.serving.llama import RuleGuard

    current, pushed = FakeUpstream("3"), FakeUpstream("4")
    current.head_rule = (Path("h.gguf"), SpecParams(4, 0.0))
    slot = DrafterSlot(current)
    stopped = []

    class Factory:
        cfg = type("C", (), {"engine": type("E", (), {"start_timeout_s": 5.0})()})()

        def step_costs(self, head):
            from runtime.llamacpp.costs import StepCosts

            return StepCosts((1.0, 1.2, 1.4, 1.6, 1.8))

        def launch(self, head, spec):
            return LaunchSpec(binary=Path("/x"), model=Path("t.gguf"), head=head, spec=spec)

    def start(self, timeout_s=120.0):
        slot.swap(pushed)  # the hot-swapper lands a new version while the guard's process starts
        return self

    monkeypatch.setattr(Upstream, "start", start)
    monkeypatch.setattr(Upstream, "stop", lambda self, timeout_s=10.0: stopped.append(self))
    guard = RuleGuard(Factory(), slot)
    guard._busy = True
    guard._check(current, requests=24, tokens=24, steps=24, drafted=96)  # drafted a lot, accepted nothing
    assert slot.get() is pushed and guard.switches == 0
    assert len(stopped) == 1 and stopped[0] is not pushed and stopped[0] is not current
    assert not guard._busy


def test_swap_if_installs_only_over_what_it_expects():
    a, b, c = object(), object(), object()
    slot = DrafterSlot(a)
    assert not slot.swap_if(b, c) and slot.get() is a
    assert slot.swap_if(a, c) and slot.get() is c


def test_the_guards_counts_go_with_their_upstream():
    """Counts were keyed by id(upstream): a later upstream at a freed address inherited another
    head's counts. They are now the upstream's own, gone once it is."""
    import gc

    from online.serving.llama import RuleGuard

    up = FakeUpstream("3")
    up.head_rule = (Path("h.gguf"), SpecParams(4, 0.0))
    slot = DrafterSlot(up)
    guard = RuleGuard(object(), slot, window=100, window_steps=10_000)
    guard.observe(up, type("S", (), {"output_tokens": 8, "steps": 4, "drafted": 8})())
    assert list(guard._counts.values()) == [[1, 8, 4, 8]]
    slot.swap(FakeUpstream("4"))
    del up
    gc.collect()
    assert len(guard._counts) == 0


FAKE_SERVER = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""

PARENT = """
import signal, sys, time
from pathlib import Path
from online.commands.daemon import exit_on_termination
from runtime.llamacpp.upstream import LaunchSpec, Upstream

signal.signal(signal.SIGHUP, signal.SIG_DFL)  # a terminal's session, whatever ran the tests (nohup ignores it)
exit_on_termination()  # what `livedraft` (online.cli.main) installs before any command runs
up = Upstream(LaunchSpec(binary=Path(sys.argv[1]), model=Path("t.gguf"))).start(30)
print(up.process.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_our_llama_server_processes_end_with_us(tmp_path, sig):
    """llama-server runs in its own session, so only our exit hook stops it: a SIGTERM before a
    command's drain handlers are in place (a minutes-long startup), or a SIGHUP (a closed
    terminal), used to end Python without its exit hooks and leave llama-server running."""
    import os
    import signal
    import subprocess
    import sys
    import time

    fake = tmp_path / "llama-server"
    fake.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    fake.chmod(0o755)
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(fake)], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[1])
    try:
        child = int(parent.stdout.readline())
        os.kill(child, 0)  # running
        parent.send_signal(getattr(signal, sig))
        assert parent.wait(20) == 128 + getattr(signal, sig)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail(f"llama-server (pid {child}) outlived livedraft after {sig}")
    finally:
        parent.kill()
        parent.wait()


def test_a_target_conversion_that_fails_leaves_no_partial_file(tmp_path, monkeypatch):
    """A failed (or interrupted) conversion of the target to GGUF used to leave a full-size
    `.partial` file in the cache; it is removed, and the next start converts again."""
    import runtime.llamacpp.convert as convert
    from online.config import Config
    from online.serving.llama import resolve_llama_target

    hf = tmp_path / "tiny-model"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    cfg = Config(data_dir=str(tmp_path / "data"))
    cfg.models.cache_dir = str(tmp_path / "cache")

    def half_written(hf_dir, out, outtype, *, locations=None):
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_bytes(b"GGUF" + b"\0" * 1024)
        raise convert.LivedraftError("convert_hf_to_gguf.py failed: out of disk")

    monkeypatch.setattr(convert, "hf_to_gguf", half_written)
    with pytest.raises(convert.LivedraftError, match="out of disk"):
        resolve_llama_target(str(hf), cfg)
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == []


def test_a_start_whose_port_was_taken_meanwhile_is_tried_again_on_another_port(tmp_path):
    """The port is chosen free, then closed, then bound by llama-server: another process can take it
    in between. llama-server then exits with its bind error, and the start is tried on a new port."""
    import sys

    from runtime.llamacpp.upstream import BIND_FAILURE

    fails = tmp_path / "fails"
    fake = tmp_path / "llama-server"
    fake.write_text(f"""#!{sys.executable}
import pathlib, sys
left = pathlib.Path({str(fails)!r})
n = int(left.read_text())
if n > 0:
    left.write_text(str(n - 1))
    print("start: {BIND_FAILURE}, hostname: 127.0.0.1", file=sys.stderr)
    sys.exit(1)
{FAKE_SERVER}""")
    fake.chmod(0o755)
    launch = LaunchSpec(binary=fake, model=Path("t.gguf"))
    fails.write_text("2")
    up = Upstream(launch).start(30)
    try:
        assert up.alive and up.healthy() and fails.read_text() == "0"
    finally:
        up.kill()
    fails.write_text("3")  # BIND_ATTEMPTS in a row: the last failure is the error
    with pytest.raises(UpstreamError, match="exited with code 1 while starting: start: couldn't bind"):
        Upstream(launch).start(30)
