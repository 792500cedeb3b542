"""The lean batched Llama forward (runtime/llama.py) computes what the Hugging Face forward computes:
one row through prefill, decode and rollback; ragged batches row for row; EAGLE-3 features."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from devkit.models import tiny_llama
from runtime.drafters.factory import load_model_drafter
from runtime.drafters.model import ModelDrafter
from runtime.kv import crop_to
from runtime.llama import KVCache, Linear, LlamaRunner, unsupported_reason
from runtime.target import HFTarget, LlamaTarget, default_feature_layers
from tests.drafting import draft

# (op, arg): feed a list of ids, or crop to a length — prefill, decode, rollback, multi-token refeed.
SCRIPT = [("feed", [5, 9, 13, 2, 7, 40, 3]), ("feed", [11]), ("feed", [12, 14]), ("crop", 8),
          ("feed", [30, 31, 32]), ("crop", 3), ("feed", [1]), ("feed", [60, 61, 62, 63, 64])]


def hf_logits(model, cache: DynamicCache, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0]


def run_both(model, row: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    runner, cache = LlamaRunner(model), DynamicCache(config=model.config)
    kv, pairs = runner.new_cache(slots=row + 1, capacity=4), []
    with torch.inference_mode():
        for op, arg in SCRIPT:
            if op == "crop":
                kv.crop(row, arg)
                crop_to(cache, arg)
            else:
                pairs.append((hf_logits(model, cache, arg), runner.forward(kv, [row], [arg]).logits[0]))
    return pairs


def test_matches_hf_forward_through_decode_and_rollback():
    model = tiny_llama(vocab=96, layers=3, hidden=32)  # 4 query heads over 2 KV heads (GQA)
    pairs = run_both(model, row=2)  # a row other than 0: slots are independent
    assert len(pairs) == 6
    for ref, got in pairs:
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_matches_hf_forward_on_stories260k(stories):
    for ref, got in run_both(stories.model):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        assert got.argmax(-1).tolist() == ref.argmax(-1).tolist()


def test_ragged_batch_equals_each_row_alone():
    model = tiny_llama(vocab=96, layers=2, hidden=32)
    runner = LlamaRunner(model)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (5, 11, 2)]
    nxt = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (3, 1, 4)]
    solo = []
    with torch.inference_mode():
        for p, x in zip(prompts, nxt, strict=True):
            kv = runner.new_cache(1)
            runner.forward(kv, [0], [p], logits="last")
            solo.append(runner.forward(kv, [0], [x]).logits[0])
        kv = runner.new_cache(3)
        # rows out of order and prefilled together with different lengths
        runner.forward(kv, [2, 0, 1], [prompts[2], prompts[0], prompts[1]], logits="last")
        assert kv.lengths == [5, 11, 2]
        both = runner.forward(kv, [0, 1, 2], nxt).logits  # [3, 4, V]
    assert kv.lengths == [8, 12, 6]  # padding is never counted as cached
    for b, ref in enumerate(solo):
        torch.testing.assert_close(both[b, : len(nxt[b])], ref, rtol=1e-4, atol=1e-4)


def test_prompt_chunks_packed_beside_decode_rows_equal_each_row_alone():
    """Rows wider than NARROW_WIDTH (prompt chunks) attend on their own but share every linear
    layer with the narrow (decode) rows; per-row logits counts return each row's last n positions."""
    from runtime.llama import NARROW_WIDTH

    model = tiny_llama(vocab=96, layers=2, hidden=32)
    runner = LlamaRunner(model, aux_layers=(1,))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (5, 7, 3)]
    feeds = [[4, 5, 6], [9], torch.randint(3, 96, (NARROW_WIDTH + 9,), generator=g).tolist(),
             torch.randint(3, 96, (NARROW_WIDTH + 2,), generator=g).tolist()]
    keep = [3, 1, 1, 2]
    solo = []
    with torch.inference_mode():
        for i, x in enumerate(feeds):
            kv = runner.new_cache(1)
            if i < len(prompts):
                runner.forward(kv, [0], [prompts[i]], logits="last")
            solo.append(runner.forward(kv, [0], [x], features=True))
        kv = runner.new_cache(4)
        runner.forward(kv, [0, 1, 2], prompts, logits="last")
        both = runner.forward(kv, [0, 1, 2, 3], feeds, logits=keep, features=True)
        assert kv.lengths == [8, 8, 3 + NARROW_WIDTH + 9, NARROW_WIDTH + 2]
        assert both.logits.shape[:2] == (4, 3) and both.features.shape[:2] == (4, NARROW_WIDTH + 9)
        for b, ref in enumerate(solo):
            torch.testing.assert_close(both.logits[b, : keep[b]], ref.logits[0, len(feeds[b]) - keep[b]:],
                                       rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(both.features[b, : len(feeds[b])], ref.features[0], rtol=1e-4, atol=1e-4)
        # the next decode step of every row still matches a fresh forward over its sequence
        nxt = runner.forward(kv, [0, 1, 2, 3], [[7], [8], [9], [10]], logits="last").logits
        for b in range(4):
            ref_kv = runner.new_cache(1)
            seq = (prompts[b] if b < len(prompts) else []) + feeds[b] + [7 + b]
            ref = runner.forward(ref_kv, [0], [seq], logits="last").logits[0]
            torch.testing.assert_close(nxt[b], ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="per-row logits counts"):
        runner.forward(runner.new_cache(1), [0], [[1, 2]], logits=[3])


def test_features_are_the_hidden_states_at_the_input_of_the_chosen_layers(stories):
    layers = default_feature_layers(stories.model.config.num_hidden_layers)
    assert layers == (0, 2, 4)  # the story model has 5 layers: too few for EAGLE-3's (2, L/2, L-3)
    assert default_feature_layers(30) == (2, 15, 27)  # SmolLM2-135M
    ids = stories.tokenizer("Once upon a time, there was a dog named").input_ids
    with torch.inference_mode():
        hf = stories.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        want = torch.cat([hf.hidden_states[i][0] for i in layers], dim=-1)
        lean = LlamaTarget(stories.model)
        lean.reset(0)
        got = lean.forward([0], [ids[:4]], logits="last", features=True).features[0]
        got = torch.cat([got, lean.forward([0], [ids[4:]], features=True).features[0]])
        slow = HFTarget(stories.model)
        slow.reset(0)
        ref = slow.forward([0], [ids], features=True).features[0]
    assert lean.feature_size == slow.feature_size == 3 * stories.model.config.hidden_size
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5)


def test_kv_cache_grows_and_keeps_contents():
    kv = KVCache(1, 1, 2, slots=1, capacity=2, dtype=torch.float32, device=torch.device("cpu"))
    kv.k[0, 0, 0, :2] = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    kv.lengths[0] = 2
    kv.reserve(5)
    assert kv.capacity == 8
    assert kv.k[0, 0, 0, :2].tolist() == [[1.0, 2.0], [3.0, 4.0]]
    kv.add_slots(3)
    assert kv.slots == 3 and kv.lengths == [2, 0, 0]
    assert kv.k[0, 0, 0, :2].tolist() == [[1.0, 2.0], [3.0, 4.0]]
    kv.crop(0, 1)
    assert kv.lengths[0] == 1
    kv.crop(0, 10)  # never extends
    assert kv.lengths[0] == 1


def test_long_sequence_past_initial_capacity():
    model = tiny_llama(vocab=96, layers=2, hidden=32, ctx=1024)
    runner = LlamaRunner(model)
    kv = runner.new_cache(1)
    ids = [int(i) for i in torch.randint(3, 96, (600,), generator=torch.Generator().manual_seed(1))]
    with torch.inference_mode():
        runner.forward(kv, [0], [ids[:300]], logits=None)
        got = runner.forward(kv, [0], [ids[300:]], logits="last").logits[0]
        ref = model(input_ids=torch.tensor([ids])).logits[0, -1]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("pack", "choice"), [(True, "mkl"), (True, "onednn"), (True, "native"),
                                              (False, "mkl"), (False, "native")])
@pytest.mark.parametrize("rows", [1, 3, 15, 37])
def test_linear_takes_the_chosen_kernel_and_equals_f_linear(pack, choice, rows, monkeypatch):
    """Whichever kernel the calibration picks for a row count computes the same projection, and
    the call takes that kernel (the prepacked one beyond the calibrated counts)."""
    from runtime import native
    from runtime.llama import _CALIBRATED_ROWS

    if choice == "native" and native.kernel() is None:
        pytest.skip(f"no native kernel here: {native.unavailable_reason()}")
    w, b, x = torch.randn(40, 24), torch.randn(40), torch.randn(rows, 1, 24)
    lin = Linear(w, b, pack=pack, native_kernel=choice == "native")
    lin._choice = (choice,) * len(_CALIBRATED_ROWS)
    expected = choice if rows <= _CALIBRATED_ROWS[-1] else ("onednn" if pack else "mkl")
    assert lin.kernel_for(rows) == expected
    calls = []
    spies = (("onednn", torch.ops.mkldnn, "_linear_pointwise"), ("mkl", torch.nn.functional, "linear"))
    for name, owner, attr in spies:
        fn = getattr(owner, attr)
        monkeypatch.setattr(owner, attr, lambda *a, fn=fn, name=name, **k: calls.append(name) or fn(*a, **k))
    got = lin(x)
    monkeypatch.undo()
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)
    assert calls == ([] if expected == "native" else [expected])


def test_packed_calls_beyond_the_calibrated_rows_run_at_few_row_counts(monkeypatch):
    """oneDNN builds a kernel per new row count: a probe's catch-up, a prompt chunk, a trace's pass
    each fed another one. Beyond the calibrated counts the rows are padded to four counts per
    power of two, under 25 % more rows, and the padding never reaches the output."""
    from runtime.llama import _CALIBRATED_ROWS, packed_rows

    assert [packed_rows(n) for n in (9, 10, 11, 17, 37, 100, 129, 4000)] == [10, 10, 12, 20, 40, 112, 160, 4096]
    counts = {packed_rows(n) for n in range(_CALIBRATED_ROWS[-1] + 1, 1025)}
    assert len(counts) <= 4 * 8 and all(packed_rows(n) >= n and packed_rows(n) < 1.25 * n for n in range(9, 5000))
    seen = []
    op = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: seen.append(x.shape[0]) or op(x, *a))
    w, b = torch.randn(40, 24), torch.randn(40)
    lin = Linear(w, b, pack=True)
    for n in (33, 35, 37, 40):
        x = torch.randn(1, n, 24)
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)
    assert seen == [40] * 4


def test_kernel_calibration_covers_every_row_count():
    from runtime import native
    from runtime.llama import _CALIBRATED_ROWS, kernel_choice

    have_native = native.kernel() is not None
    for packed, native_kernel, allowed in ((True, have_native, {"mkl", "onednn", "native"}), (False, False, {"mkl"})):
        choice = kernel_choice(24, 40, torch.get_num_threads(), packed=packed, native_kernel=native_kernel)
        assert len(choice) == len(_CALIBRATED_ROWS) and set(choice) <= allowed


def test_unsupported_models_fall_back_to_hf_forward():
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, hidden_act="gelu")
    model = LlamaForCausalLM(cfg).eval()
    assert "gelu" in unsupported_reason(model)
    with pytest.raises(ValueError, match="gelu"):
        LlamaRunner(model)
    drafter = ModelDrafter(model, 64)
    assert drafter.runner is None
    drafter.begin("r", [1, 2, 3], tag=None)
    assert len(draft(drafter, "r", [1, 2, 3], 3).tokens) == 3


@pytest.mark.parametrize("vocab_trim", [False, True])
def test_fast_drafter_drafts_what_the_hf_drafter_drafts(stories, stories_drafter_dir, vocab_trim):
    prompt = stories.tokenizer("Once upon a time, there was a little girl named").input_ids
    drafts = {}
    for fast in (True, False):
        base = load_model_drafter(stories_drafter_dir, stories)
        kept = list(range(0, stories.vocab_size, 2)) + [stories.vocab_size - 1] if vocab_trim else None
        d = ModelDrafter(base.model, stories.vocab_size, kept_ids=kept, fast=fast)
        assert (d.runner is not None) == fast
        d.begin("r", prompt, tag=None)
        ctx, out = list(prompt), []
        for step in range(6):
            got = draft(d, "r", ctx, 4)
            out.append((got.tokens, got.probs))
            ctx = ctx + got.tokens[: step % 3] + [step + 7]  # partial acceptance, then a correction
        drafts[fast] = out
    for (ft, fp), (ht, hp) in zip(drafts[True], drafts[False], strict=True):
        assert ft == ht
        torch.testing.assert_close(fp, hp, rtol=1e-4, atol=1e-5)


def test_model_drafter_batch_drafts_what_each_row_drafts_alone(stories, stories_drafter_dir):
    prompts = [stories.tokenizer(p).input_ids for p in
               ("Once upon a time", "Lily and Tom went to the park. Lily said,", "The bird")]
    alone = []
    for i, p in enumerate(prompts):
        d = load_model_drafter(stories_drafter_dir, stories)
        d.begin(f"r{i}", p, tag=None)
        alone.append(draft(d, f"r{i}", p, 2 + i).tokens)
    d = load_model_drafter(stories_drafter_dir, stories)
    from runtime.drafters.base import DraftRow

    for i, p in enumerate(prompts):
        d.begin(f"r{i}", p, tag=None)
    together = d.propose([DraftRow(f"r{i}", p, 2 + i) for i, p in enumerate(prompts)])
    assert [x.tokens for x in together] == alone
