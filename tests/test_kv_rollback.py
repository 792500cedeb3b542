"""After a rejection mid-draft, the caches are rolled back exactly: the next step's logits
equal a fresh forward pass over the accepted sequence (target and model drafter)."""

from __future__ import annotations

import torch

from runtime.adaptive import DraftLengthConfig
from runtime.drafters.base import Draft
from runtime.drafters.model import ModelDrafter
from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine
from runtime.target import HFTarget
from tests.models import tiny_llama


def fresh_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0]


class CheckingTarget(HFTarget):
    """Tracks the ids its cache should hold and checks every verify against a fresh pass."""

    def __init__(self, model):
        super().__init__(model)
        self.ids: list[int] = []
        self.checked_after_rejection = 0
        self._rejected = False

    def prefill(self, prompt_ids):
        self.ids = list(prompt_ids)
        return super().prefill(prompt_ids)

    def verify(self, ids):
        got = super().verify(ids)
        self.ids += ids
        want = fresh_logits(self.model, self.ids)[-len(ids):]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        if self._rejected:
            self.checked_after_rejection += 1
        return got

    def rollback(self, length):
        self._rejected = length < len(self.ids)  # something was cropped: a draft token was rejected
        # The cache holds ids[:length]; the pending bonus token is not cached yet.
        self.ids = self.ids[:length]
        super().rollback(length)
        assert self.cache.get_seq_length() == length


class HalfRightDrafter:
    """Proposes the target's true greedy continuation for `right` tokens, then a wrong one."""

    version = "half-right"

    def __init__(self, model, right: int):
        self.model, self.right = model, right

    def begin(self, req_id, prompt_ids):
        pass

    def propose(self, req_id, context_ids, max_tokens, **_):
        ctx = list(context_ids)
        for _ in range(min(self.right, max_tokens)):
            ctx.append(int(fresh_logits(self.model, ctx)[-1].argmax()))
        tokens = ctx[len(context_ids):]
        if len(tokens) < max_tokens:
            tokens.append((int(fresh_logits(self.model, ctx)[-1].argmax()) + 1) % 64)  # certainly rejected
        return Draft(tokens, "model")

    def observe(self, req_id, accepted_ids, num_accepted):
        pass

    def end(self, req_id):
        pass


def test_target_cache_rolls_back_exactly_after_mid_draft_rejection():
    target = tiny_llama(vocab=64, layers=2, seed=0)
    checking = CheckingTarget(target)
    drafter = HalfRightDrafter(target, right=2)
    engine = SpeculativeEngine(checking, drafter, eos_ids=set(), max_context=256,
                               config=EngineConfig(draft=DraftLengthConfig(k=5)))
    res = engine.generate([1, 7, 9, 11, 13], SamplingParams(max_new_tokens=60))
    partial = [s for s in res.trace.steps if 0 < s.accepted < len(s.drafted)]
    assert len(partial) >= 10  # mid-draft rejections happened, so rollbacks were exercised
    assert checking.checked_after_rejection >= 10
    assert res.output_ids == fresh_greedy(target, [1, 7, 9, 11, 13], 60)


def fresh_greedy(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(fresh_logits(model, ids)[-1].argmax()))
    return ids[len(prompt):]


def test_model_drafter_rolls_back_its_cache():
    model = tiny_llama(vocab=64, layers=1, seed=1)
    drafter = ModelDrafter(model, 64)
    drafter.begin("r", [1, 2, 3])
    first = drafter.propose("r", [1, 2, 3], 4)
    # The target accepted one draft token and corrected the second.
    accepted = [1, 2, 3, first.tokens[0], (first.tokens[1] + 1) % 64]
    second = drafter.propose("r", accepted, 1)
    want = torch.softmax(fresh_logits(model, accepted)[-1], -1)
    torch.testing.assert_close(second.probs[0], want, rtol=1e-4, atol=1e-5)
    assert drafter._requests["r"].cache.get_seq_length() == len(accepted)


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
