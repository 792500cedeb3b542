"""Synthetic RequestTraces shaped like real traffic, for tests and the stream benchmark."""

from __future__ import annotations

import random

from runtime.trace import RequestTrace, StepRecord, Timings


def synthetic_trace(
    rng: random.Random,
    *,
    prompt_len: int = 64,
    output_len: int = 256,
    draft_len: int = 4,
    topk: int = 8,
    vocab: int = 49152,
    tag: str | None = None,
    drafter_version: str = "v1",
    created_at: float | None = None,
) -> RequestTrace:
    """A greedy trace whose steps cover `output_len` tokens with `draft_len`-token drafts.

    Each step accepts 0..draft_len tokens (plus the target's bonus token); a step with a
    rejection carries `topk` soft labels, as the engine logs them. Deterministic in `rng`.
    """
    output = [rng.randrange(vocab) for _ in range(output_len)]
    steps: list[StepRecord] = []
    pos = 0
    while pos < output_len:
        accepted = min(rng.choice((0, 1, 2, 3, 4, 4)), draft_len, output_len - pos - 1)
        step = StepRecord(pos, output[pos:pos + accepted] + [rng.randrange(vocab)
                                                             for _ in range(draft_len - accepted)],
                          "model", accepted)
        if accepted < draft_len:
            step.topk_ids = rng.sample(range(vocab), topk)
            step.topk_logprobs = sorted((-rng.expovariate(1.0) for _ in range(topk)), reverse=True)
        steps.append(step)
        pos += accepted + 1
    now = rng.random() * 1e6 + 1.7e9 if created_at is None else created_at
    return RequestTrace(
        request_id=f"req-{rng.getrandbits(64):016x}",
        prompt_ids=[rng.randrange(vocab) for _ in range(prompt_len)],
        output_ids=output,
        steps=steps,
        target_model="synthetic-target",
        drafter_version=drafter_version,
        max_new_tokens=output_len,
        tag=tag,
        timings=Timings(0.01, 0.02, 0.03, 0.06),
        created_at=now,
        finished_at=now + 0.06,
        trace_id=f"{rng.getrandbits(128):032x}",
        event_id=f"{rng.getrandbits(128):032x}",
    )
