"""The lean Llama forward (runtime/fast_llama.py) computes what the Hugging Face forward computes."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from runtime.drafters.factory import load_model_drafter
from runtime.drafters.model import ModelDrafter
from runtime.fast_llama import FastLlama, KVBuffer, unsupported_reason
from runtime.kv import crop_to
from tests.models import tiny_llama

# (op, arg): feed a list of ids, or crop to a length — prefill, decode, rollback, multi-token refeed.
SCRIPT = [("feed", [5, 9, 13, 2, 7, 40, 3]), ("feed", [11]), ("feed", [12, 14]), ("crop", 8),
          ("feed", [30, 31, 32]), ("crop", 3), ("feed", [1]), ("feed", [60, 61, 62, 63, 64])]


def hf_last_logits(model, cache: DynamicCache, ids: list[int]) -> torch.Tensor:
    out = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return out.logits[0, -1]


def run_both(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    fast, buf, cache, pairs = FastLlama(model), None, DynamicCache(config=model.config), []
    buf = fast.new_buffer()
    with torch.inference_mode():
        for op, arg in SCRIPT:
            if op == "crop":
                buf.crop(arg)
                crop_to(cache, arg)
            else:
                pairs.append((hf_last_logits(model, cache, arg), fast.forward(buf, arg)))
    return pairs


def test_matches_hf_forward_through_decode_and_rollback():
    model = tiny_llama(vocab=96, layers=3, hidden=32)  # 4 query heads over 2 KV heads (GQA)
    pairs = run_both(model)
    assert len(pairs) == 6
    for ref, got in pairs:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_matches_hf_forward_on_stories260k(stories):
    for ref, got in run_both(stories.model):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        assert int(got.argmax()) == int(ref.argmax())


def test_kv_buffer_grows_and_keeps_contents():
    buf = KVBuffer(layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"), capacity=2)
    buf.k[0, 0, :2] = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    buf.length = 2
    buf.reserve(5)
    assert buf.k.shape[2] == 8
    assert buf.k[0, 0, :2].tolist() == [[1.0, 2.0], [3.0, 4.0]]
    buf.crop(1)
    assert buf.length == 1
    buf.crop(10)  # never extends
    assert buf.length == 1


def test_long_sequence_past_initial_capacity():
    model = tiny_llama(vocab=96, layers=2, hidden=32, ctx=1024)
    fast, buf = FastLlama(model), None
    buf = fast.new_buffer()
    ids = [int(i) for i in torch.randint(3, 96, (600,), generator=torch.Generator().manual_seed(1))]
    with torch.inference_mode():
        fast.forward(buf, ids[:300])
        got = fast.forward(buf, ids[300:])
        ref = model(input_ids=torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_unsupported_models_fall_back_to_hf_forward():
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, hidden_act="gelu")
    model = LlamaForCausalLM(cfg).eval()
    assert "gelu" in unsupported_reason(model)
    with pytest.raises(ValueError, match="gelu"):
        FastLlama(model)
    drafter = ModelDrafter(model, 64)
    assert drafter.fast is None
    drafter.begin("r", [1, 2, 3])
    assert len(drafter.propose("r", [1, 2, 3], 3).tokens) == 3


@pytest.mark.parametrize("vocab_trim", [False, True])
def test_fast_drafter_drafts_what_the_hf_drafter_drafts(stories, stories_drafter_dir, vocab_trim):
    prompt = stories.tokenizer("Once upon a time, there was a little girl named").input_ids
    drafts = {}
    for fast in (True, False):
        base = load_model_drafter(stories_drafter_dir, stories)
        kept = list(range(0, stories.vocab_size, 2)) + [stories.vocab_size - 1] if vocab_trim else None
        d = ModelDrafter(base.model, stories.vocab_size, kept_ids=kept, fast=fast)
        assert (d.fast is not None) == fast
        d.begin("r", prompt)
        ctx, out = list(prompt), []
        for step in range(6):
            draft = d.propose("r", ctx, 4)
            out.append((draft.tokens, draft.probs))
            ctx = ctx + draft.tokens[: step % 3] + [step + 7]  # partial acceptance, then a correction
        drafts[fast] = out
    for (ft, fp), (ht, hp) in zip(drafts[True], drafts[False], strict=True):
        assert ft == ht
        torch.testing.assert_close(fp, hp, rtol=1e-4, atol=1e-5)
