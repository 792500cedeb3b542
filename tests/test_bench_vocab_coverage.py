"""bench.draft_vocab_coverage: its oracle counts steps as the replay engine does."""

from __future__ import annotations

import random

import pytest

from bench.draft_vocab_coverage import coverage_row, oracle_counts, oracle_steps
from online.replay.engine import replay_traces
from runtime.drafters.base import Draft, DraftRow, RowwiseDrafter
from runtime.engine import DraftLengthConfig
from runtime.trace import RequestTrace


class WithinVocab(RowwiseDrafter):
    """Drafts the logged answer's next tokens while they are in `vocab`, then a wrong token."""

    version = "oracle"

    def __init__(self, answers: dict[str, list[int]], vocab: set[int] | None):
        self.answers, self.vocab, self.prompts = answers, vocab, {}

    def begin(self, req_id, prompt_ids, *, tag=None):
        self.prompts[req_id] = len(prompt_ids)

    def propose_row(self, row: DraftRow) -> Draft:
        answer = self.answers[row.req_id]
        pos = len(row.context) - self.prompts[row.req_id]  # answer tokens known, the last pending
        tokens = []
        for tok in answer[pos: pos + row.max_tokens]:
            if self.vocab is not None and tok not in self.vocab:
                break
            tokens.append(tok)
        if len(tokens) < row.max_tokens:
            tokens.append(999)  # never logged: rejected
        return Draft(tokens, "oracle")

    def end(self, req_id, output_ids=None):
        self.prompts.pop(req_id, None)


def traces(n: int, seed: int) -> list[RequestTrace]:
    """Half stopped on an end token (20, in no vocabulary below but the full one), half at their length."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        answer = [rng.randrange(20) for _ in range(rng.randrange(1, 40))]
        stop = i % 2 == 0
        out.append(RequestTrace(f"r{i}", [1, 2, 3], answer + [20] if stop else answer, [], "target", "v0",
                                max_new_tokens=len(answer) + 8 if stop else len(answer),
                                finish_reason="stop" if stop else "length"))
    return out


@pytest.mark.parametrize("vocab", [None, set(range(15)), set(range(5)), set()])
@pytest.mark.parametrize("k", [1, 4])
def test_the_oracle_counts_as_the_replay_engine(vocab, k):
    logged = traces(12, seed=k)
    drafter = WithinVocab({t.request_id: t.output_ids for t in logged}, vocab)
    report = replay_traces(logged, drafter, length=DraftLengthConfig(k=k), vocab_size=1000)
    assert (report.stats.steps, report.stats.accepted) == oracle_counts(logged, vocab, k)
    coverage, cap = coverage_row(logged, vocab, k)
    assert cap == pytest.approx(report.stats.mean_acceptance_length)
    tokens = [x for t in logged for x in t.output_ids]
    assert coverage == pytest.approx(1.0 if vocab is None else sum(x in vocab for x in tokens) / len(tokens))


def test_a_full_vocabulary_reaches_the_k_step_maximum():
    assert oracle_steps(list(range(11)), None, 4) == (2, 8)  # 1 from the prefill, then 5 + 5
    assert oracle_steps(list(range(11)), {0}, 4) == (10, 0)  # nothing drafted right: one token a step
