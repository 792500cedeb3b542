"""Swap under load (issue #4 point 13): concurrent HTTP clients while the drafter is hot-swapped
several times. No request fails, every greedy output equals the target's own, and the swap pause
(how long a swap holds the drafter slot) is measured and small."""

from __future__ import annotations

import threading
import time

from online.config import Config
from online.serving.engine import start_serving
from runtime.drafters.factory import load_model_drafter
from runtime.drafters.lookup import PromptLookupDrafter
from tests.serving_utils import FakeSource, complete, hf_greedy, request, run_threads, sse_events

PROMPTS = [
    "Once upon a time, there was a dog named",
    "Lily and Tom went to the park. Lily said,",
    "The little bird was sad because",
    "One day, a big bear",
    "Sam had a red ball. He",
]
MAX_NEW = 24
CLIENTS = 6
PER_CLIENT = 5
SWAPS = 6
MAX_PAUSE_S = 0.05


def test_concurrent_clients_while_swapping(stories, stories_drafter_dir):
    expected = {p: hf_greedy(stories.model, stories.tokenizer(p).input_ids, MAX_NEW) for p in PROMPTS}
    # Three kinds of drafter, loaded from disk in the watcher thread while requests run.
    kinds = [lambda: load_model_drafter(stories.path, stories),
             lambda: load_model_drafter(stories_drafter_dir, stories),
             lambda: PromptLookupDrafter()]
    source = FakeSource({f"v{i}": kinds[i % 3] for i in range(1, SWAPS + 1)})
    cfg = Config()
    cfg.serve.port, cfg.serve.poll_s = 0, 3600.0  # only trigger() polls
    cfg.serve.rollback_max_drop = 1.0  # never roll back here: the test counts swaps exactly
    handle = start_serving(cfg, target=stories, drafter_source=source, initial_drafter=kinds[0]())
    done = 0
    done_cond = threading.Condition()
    versions: list[str] = []
    failures: list[str] = []

    def client(i: int) -> None:
        nonlocal done
        for j in range(PER_CLIENT):
            prompt = PROMPTS[(i + j) % len(PROMPTS)]
            body = {"prompt": prompt, "max_tokens": MAX_NEW, "stream": j % 2 == 1}
            status, payload, _ = request(handle.url, "POST", "/v1/completions", body, {"X-Client-Id": f"c{i}"})
            if status != 200:
                failures.append(f"client {i} request {j}: {status} {payload}")
            else:
                info = sse_events(payload)[-2]["livedraft"] if body["stream"] else payload["livedraft"]
                if info["output_ids"] != expected[prompt]:
                    failures.append(f"client {i} request {j}: output changed under drafter {info['drafter_version']}")
                versions.append(info["drafter_version"])
            with done_cond:
                done += 1
                done_cond.notify_all()

    def publisher() -> None:
        step = CLIENTS * PER_CLIENT // (SWAPS + 1)
        for n in range(1, SWAPS + 1):
            with done_cond:
                assert done_cond.wait_for(lambda n=n: done >= n * step, 120)
            source.wanted = f"v{n}"
            handle.swapper.trigger()
            deadline = time.monotonic() + 60
            while handle.swapper.version != f"v{n}":
                assert time.monotonic() < deadline, f"swap to v{n} did not happen"
                time.sleep(0.002)

    pub = threading.Thread(target=publisher)
    t0 = time.monotonic()
    try:
        pub.start()
        errors = run_threads(CLIENTS, client)
        pub.join(120)
        wall = time.monotonic() - t0
        assert errors == [] and failures == []
        assert len(versions) == CLIENTS * PER_CLIENT
        status = handle.swapper.status()
        assert status["swaps"] == SWAPS and status["load_failures"] == 0 and status["rollbacks"] == 0
        assert len(set(versions)) >= 4  # the traffic really spanned several versions
        pauses = [e["pause_s"] for e in status["history"] if e["kind"] == "swap"]
        print(f"\nswap under load: {CLIENTS} clients x {PER_CLIENT} requests, {SWAPS} swaps in {wall:.1f}s; "
              f"swap pause max {max(pauses) * 1e6:.0f} us, mean {sum(pauses) / len(pauses) * 1e6:.0f} us; "
              f"requests per version {dict(sorted((v, versions.count(v)) for v in set(versions)))}")
        assert 0.0 < status["max_swap_pause_s"] == max(pauses) < MAX_PAUSE_S
        metrics = request(handle.url, "GET", "/metrics")[1]
        assert f"livedraft_drafter_swaps_total {float(SWAPS)}" in metrics
        assert 'livedraft_requests_total{status="ok"} ' + f"{float(CLIENTS * PER_CLIENT)}" in metrics
        # and the server still answers normally afterwards
        prompt = PROMPTS[0]
        assert complete(handle.url, {"prompt": prompt, "max_tokens": MAX_NEW})[1]["livedraft"]["output_ids"] \
            == expected[prompt]
    finally:
        assert handle.stop(30.0)
