"""Helpers for the server tests: a tiny HTTP client, an SSE reader, a settable DrafterSource."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import torch

from runtime.drafters.base import Drafter
from runtime.drafters.factory import load_model_drafter
from runtime.drafters.model import ModelDrafter
from runtime.hotswap import DrafterRef


class FakeSource:
    """A DrafterSource whose wanted version the test sets; loads through callables."""

    def __init__(self, loaders: dict[str, Callable[[], Drafter]]) -> None:
        self.loaders = loaders
        self.wanted: str | None = None
        self.loads: list[str] = []
        self.rollbacks: list[tuple[str, str, dict]] = []
        self.polls = 0

    def current(self) -> DrafterRef | None:
        self.polls += 1
        return DrafterRef(self.wanted, f"fake://{self.wanted}") if self.wanted else None

    def load(self, ref: DrafterRef) -> Drafter:
        self.loads.append(ref.version)
        return self.loaders[ref.version]()

    def report_rollback(self, ref: DrafterRef, reason: str, numbers: dict[str, float]) -> None:
        self.rollbacks.append((ref.version, reason, numbers))


def hf_greedy(model, prompt_ids: list[int], max_new: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def random_drafter(stories, drafter_dir, version: str = "bad"):
    """A model drafter with its transformer layers re-initialised: it drafts, and misses."""
    d = load_model_drafter(drafter_dir, stories, version=version)
    torch.manual_seed(123)
    with torch.no_grad():
        for name, p in d.model.named_parameters():
            if ".layers." in name and p.dim() == 2:
                p.normal_(0.0, 0.5)
    # the lean forward reads the weights once, when the drafter is built
    kept = None if d.kept_ids is None else d.kept_ids.tolist()
    return ModelDrafter(d.model, d.target_vocab_size, kept_ids=kept, version=version)


def request(url: str, method: str, path: str, body: object = None, headers: dict | None = None,
            raw: bytes | None = None, timeout: float = 60.0) -> tuple[int, dict | str, Any]:
    """One request on a fresh connection: (status, parsed JSON or text, headers)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        text = resp.read().decode()
        ctype = resp.getheader("Content-Type", "")
        payload = json.loads(text) if ctype.startswith("application/json") else text
        return resp.status, payload, resp.headers  # an HTTPMessage: header names case-insensitive
    finally:
        conn.close()


def complete(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    status, payload, _ = request(url, "POST", "/v1/completions", body, headers)
    return status, payload


def sse_events(text: str) -> list[dict | str]:
    """The `data:` payloads of an event stream, JSON-decoded except the final [DONE]."""
    out: list[dict | str] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
        elif block.strip():
            raise AssertionError(f"not an SSE event: {block!r}")
    return out


def run_threads(n: int, fn: Callable[[int], None]) -> list[BaseException]:
    """Runs fn(0..n-1) in threads; returns the exceptions they raised."""
    errors: list[BaseException] = []

    def wrap(i: int) -> None:
        try:
            fn(i)
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return errors
