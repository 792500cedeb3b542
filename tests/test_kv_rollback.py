"""After a rejection mid-draft, the caches are rolled back exactly: the next step's logits
equal a fresh forward pass over the accepted sequence (target and model drafter)."""

from __future__ import annotations

import pytest
import torch

from devkit.models import tiny_llama
from runtime.adaptive import DraftLengthConfig
from runtime.drafters.base import Draft, DraftRow, RowwiseDrafter
from runtime.drafters.model import ModelDrafter
from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine
from runtime.target import HFTarget, LlamaTarget, keep_counts
from tests.drafting import draft


def fresh_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0]


def checking(base: type):
    """`base` (a Target class) that tracks the ids each row's cache should hold and checks
    every forward against a fresh pass over them."""

    class Checking(base):
        def __init__(self, model):
            super().__init__(model)
            self.ids: dict[int, list[int]] = {}
            self.checked_after_rejection = 0
            self._rejected: dict[int, bool] = {}

        def reset(self, row, request_id=""):
            super().reset(row, request_id)
            self.ids[row] = []

        def forward(self, rows, ids, *, logits="all", features=False):
            got = super().forward(rows, ids, logits=logits, features=features)
            keep = keep_counts(logits, [len(x) for x in ids])
            for b, (row, x) in enumerate(zip(rows, ids, strict=True)):
                self.ids[row] += list(x)
                want = fresh_logits(self.model, self.ids[row])[-keep[b]:]
                torch.testing.assert_close(got.logits[b] if logits == "last" else got.logits[b, : keep[b]],
                                           want[-1] if logits == "last" else want, rtol=1e-4, atol=1e-4)
                if self._rejected.get(row):
                    self.checked_after_rejection += 1
            return got

        def rollback(self, row, length):
            # something was cropped: a draft token was rejected
            self._rejected[row] = length < len(self.ids[row])
            # The cache holds ids[:length]; the pending bonus token is not cached yet.
            self.ids[row] = self.ids[row][:length]
            super().rollback(row, length)
            assert self.cached(row) == length

    return Checking


class HalfRightDrafter(RowwiseDrafter):
    """Proposes the target's true greedy continuation for `right` tokens, then a wrong one."""

    version = "half-right"

    def __init__(self, model, right: int):
        self.model, self.right = model, right

    def begin(self, req_id, prompt_ids, *, tag=None):
        pass

    def propose_row(self, row: DraftRow) -> Draft:
        ctx = list(row.context)
        for _ in range(min(self.right, row.max_tokens)):
            ctx.append(int(fresh_logits(self.model, ctx)[-1].argmax()))
        tokens = ctx[len(row.context):]
        if len(tokens) < row.max_tokens:
            tokens.append((int(fresh_logits(self.model, ctx)[-1].argmax()) + 1) % 64)  # certainly rejected
        return Draft(tokens, "model")

    def end(self, req_id, output_ids=None):
        pass


@pytest.mark.parametrize("base", [HFTarget, LlamaTarget], ids=["hf", "lean"])
def test_target_cache_rolls_back_exactly_after_mid_draft_rejection(base):
    target = tiny_llama(vocab=64, layers=2, seed=0)
    check = checking(base)(target)
    drafter = HalfRightDrafter(target, right=2)
    engine = SpeculativeEngine(check, drafter, eos_ids=set(), max_context=256,
                               config=EngineConfig(draft=DraftLengthConfig(k=5)))
    res = engine.generate([1, 7, 9, 11, 13], SamplingParams(max_new_tokens=60))
    partial = [s for s in res.trace.steps if 0 < s.accepted < len(s.drafted)]
    assert len(partial) >= 10  # mid-draft rejections happened, so rollbacks were exercised
    assert check.checked_after_rejection >= 10
    assert res.output_ids == fresh_greedy(target, [1, 7, 9, 11, 13], 60)


def fresh_greedy(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(fresh_logits(model, ids)[-1].argmax()))
    return ids[len(prompt):]


def test_model_drafter_rolls_back_its_cache():
    model = tiny_llama(vocab=64, layers=1, seed=1)
    drafter = ModelDrafter(model, 64)
    drafter.begin("r", [1, 2, 3], tag=None)
    first = draft(drafter, "r", [1, 2, 3], 4)
    # The target accepted one draft token and corrected the second.
    accepted = [1, 2, 3, first.tokens[0], (first.tokens[1] + 1) % 64]
    second = draft(drafter, "r", accepted, 1)
    want = torch.softmax(fresh_logits(model, accepted)[-1], -1)
    torch.testing.assert_close(second.probs[0], want, rtol=1e-4, atol=1e-5)
    assert drafter.cache.lengths[drafter._requests["r"].row] == len(accepted)


def test_concurrent_model_loads_do_not_break_each_other(stories) -> None:
    """The hot-swapper and the trainer load drafters from different threads at once; transformers'
    meta-device init is process-global, so unserialised loads fail with meta-tensor errors."""
    from runtime.loader import load_model
    from tests.serving_utils import run_threads

    def load(_: int) -> None:
        for _ in range(2):
            load_model(stories.path)

    errors = run_threads(4, load)
    assert not errors, errors[:1]
