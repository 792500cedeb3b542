"""Cross-vocabulary drafting (OmniDraft): a drafter with its own tokenizer drafts for any target,
losslessly; translations spell exactly the draft's text (multi-byte characters included); the
context is re-tokenised incrementally; the online n-gram cache learns mappings and round-trips
through snapshots."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from devkit.models import tiny_llama
from runtime.adaptive import DraftLengthConfig
from runtime.drafters.crossvocab import (
    Codec,
    CrossVocabDrafter,
    TextView,
    TokenView,
    aligned_segments,
    by_text,
)
from runtime.drafters.vocab_bridge import BridgeConfig, VocabBridge
from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine
from runtime.loader import LoadedModel
from runtime.target import LlamaTarget
from tests.serving_utils import hf_greedy

CORPUS = ["the cat sat on the mat and the dog sat on the log", "a little bird sang a song in the tree",
          "tom and lily went to the park to play with a red ball", "über café naïve — 😀 日本語 text"] * 20


def byte_bpe(vocab: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2 style: the space belongs to the next token)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def metaspace_bpe(vocab: int) -> PreTrainedTokenizerFast:
    """A SentencePiece-style BPE (▁ marks a word start; a leading space is implied) with byte fallback."""
    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab,
                                                        special_tokens=["<pad>", "<s>", "</s>", *bytes_]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.fixture(scope="module")
def tokenizers_pair():
    return byte_bpe(400), metaspace_bpe(600)


def test_codecs_learn_how_each_tokenizer_splits_at_spaces(tokenizers_pair, stories):
    target, drafter = tokenizers_pair
    assert Codec(target).keeps_space and not Codec(target).drops_space
    assert Codec(drafter).drops_space
    assert Codec(stories.tokenizer).drops_space  # SentencePiece


@pytest.mark.parametrize("text", ["the cat sat on the mat and the dog", "über café — 😀 日本語 and the log",
                                  "tom  and   lily\nwent to the park"])
def test_incremental_views_equal_a_full_re_encoding(tokenizers_pair, text):
    target, drafter = (Codec(t) for t in tokenizers_pair)
    ids = target.encode(text)
    tv, dv = TextView(target), TokenView(drafter, window=6)
    for j in range(1, len(ids) + 1):
        got = tv.update(ids[:j])
        assert got == target.decode(ids[:j])
        assert drafter.decode(dv.update(got)) == drafter.decode(drafter.encode(got))
    assert tv.update(ids[:3]) == target.decode(ids[:3])  # a rewind re-decodes


@pytest.mark.parametrize("context,draft", [("the cat sat on", " the mat and the dog"),
                                           ("über café", " — 😀 日本語 text"), ("a little", " bird sang")])
def test_translation_spells_exactly_the_draft_text(tokenizers_pair, context, draft):
    target, drafter = (Codec(t) for t in tokenizers_pair)
    ctx = target.encode(context)
    d_ctx = drafter.encode(context)
    d_draft = drafter.encode(context + draft)[len(d_ctx):]
    text = drafter.text_after(d_ctx, d_draft)
    assert text == draft
    full = by_text(target, ctx, text, complete=True)
    assert target.text_after(ctx, full) == draft  # round trip: the target tokens spell the draft text
    part = by_text(target, ctx, text)
    spelled = target.text_after(ctx, part)
    assert draft.startswith(spelled) and len(part) == len(full) - 1  # the last token may run past the draft
    assert target.decode(ctx + full) == context + draft


def tiny_pair(tokenizers_pair):
    t_tok, d_tok = tokenizers_pair
    target = tiny_llama(vocab=len(t_tok), layers=2, hidden=32, seed=0)
    target.config.eos_token_id = t_tok.eos_token_id
    drafter = tiny_llama(vocab=len(d_tok), layers=1, hidden=32, seed=1)
    return LoadedModel(target, t_tok, "tiny-target", None), LoadedModel(drafter, d_tok, "tiny-drafter", None)


def test_tiny_random_models_with_different_tokenizers_are_lossless(tokenizers_pair):
    target, drafter = tiny_pair(tokenizers_pair)
    xv = CrossVocabDrafter(drafter.model, drafter.tokenizer, target.tokenizer)
    engine = SpeculativeEngine(LlamaTarget(target.model), xv, eos_ids=set(), max_context=256,
                               config=EngineConfig(draft=DraftLengthConfig(k=4)))
    drafted = 0
    for p in ("the cat sat on", "über café", "tom and lily"):
        prompt = target.tokenizer(p).input_ids
        res = engine.generate(prompt, SamplingParams(max_new_tokens=30))
        assert res.output_ids == hf_greedy(target.model, prompt, 30)
        drafted += res.stats.drafted
    assert drafted > 0


def test_stories260k_drafts_losslessly_for_smollm2(stories, smollm2):
    bridge = VocabBridge(target_tokenizer=smollm2.tokenizer, drafter_tokenizer=stories.tokenizer)
    xv = CrossVocabDrafter(stories.model, stories.tokenizer, smollm2.tokenizer, bridge=bridge)
    engine = SpeculativeEngine.for_model(smollm2, xv, EngineConfig(draft=DraftLengthConfig(k=4)))
    accepted = 0
    for p in ("Once upon a time, there was a little girl named Lily. She", "Tom had a big red ball. One day,"):
        prompt = smollm2.tokenizer(p).input_ids
        res = engine.generate(prompt, SamplingParams(max_new_tokens=24))
        assert res.output_ids == hf_greedy(smollm2.model, prompt, 24)
        accepted += res.stats.accepted
    assert accepted > 5 and bridge.num_pending == 2 and bridge.mappings() > 10  # written through, learned


def test_sampling_with_a_translated_one_hot_draft_matches_the_target(tokenizers_pair, monkeypatch):
    """The translated draft has no q of its own: verified as one-hot, the output distribution is the
    target's (chi-square over the first two sampled tokens; a broken resampling rule is caught)."""
    import runtime.verify as verify
    from tests.test_lossless_sampling import broken_residual, chi2, chi2_critical

    target, drafter = tiny_pair(tokenizers_pair)
    prompt = target.tokenizer("the cat sat").input_ids

    def dist(ctx):
        with torch.inference_mode():
            return torch.softmax(target.model(input_ids=torch.tensor([ctx])).logits[0, -1], -1)

    p1 = dist(prompt)
    top = p1.topk(6).indices.tolist()
    exact = {}
    for a in range(len(p1)):
        pa = float(p1[a])
        if pa < 1e-4:
            continue
        p2 = dist(prompt + [a])
        for b in range(len(p2)):
            exact[(a, b)] = exact.get((a, b), 0.0) + pa * float(p2[b])
    assert top

    def counts(n):
        xv = CrossVocabDrafter(drafter.model, drafter.tokenizer, target.tokenizer)
        engine = SpeculativeEngine(LlamaTarget(target.model), xv, eos_ids=set(), max_context=256,
                                   config=EngineConfig(draft=DraftLengthConfig(k=3)))
        c = {}
        for seed in range(n):
            out = engine.generate(prompt, SamplingParams(max_new_tokens=3, temperature=1.0, seed=seed)).output_ids
            c[(out[0], out[1])] = c.get((out[0], out[1]), 0) + 1
        return c

    n = 1500
    stat, df = chi2(counts(n), exact, n)
    assert stat < chi2_critical(df), f"chi2={stat:.1f} df={df}"
    monkeypatch.setattr(verify, "_residual_sample", broken_residual)
    stat, df = chi2(counts(n), exact, n)
    assert stat > chi2_critical(df)


def test_bridge_learns_mappings_and_round_trips_through_a_snapshot(tokenizers_pair):
    t_tok, d_tok = tokenizers_pair
    t, d = Codec(t_tok), Codec(d_tok)
    outputs = [t.encode(s) for s in CORPUS[:8]]
    pairs = aligned_segments(t, d, outputs[0])
    assert pairs and all(d.decode(list(dp)).strip() == t.decode(list(tp)).strip() for dp, tp in pairs)
    bridge = VocabBridge(BridgeConfig(min_count=2, max_sequences=6), target_tokenizer=t_tok, drafter_tokenizer=d_tok)
    for o in outputs:
        bridge.add_sequence(o, tag="a")
    assert bridge.num_sequences == 6 and bridge.mappings("a") > 5 and bridge.mappings("b") == 0  # tag scoped
    hits = [(dp, bridge.lookup(list(dp) + [5, 6], "a")) for dp, _ in aligned_segments(t, d, outputs[-1])]
    hits = [(dp, h) for dp, h in hits if h is not None]
    assert len(hits) > 3  # seen twice (min_count 2): mapped
    dp, (n, target_ids) = hits[0]
    assert n == len(dp) and target_ids
    restored = VocabBridge.restore(bridge.snapshot())
    assert not restored.ready  # no tokenizers in a snapshot: re-add into a bridge that has them
    again = VocabBridge(bridge.config, target_tokenizer=t_tok, drafter_tokenizer=d_tok)
    for seq in restored.sequences():
        again.add_sequence(seq.tokens, seq.tag)
    assert again.snapshot() == bridge.snapshot()
    assert again.lookup(list(dp) + [5, 6], "a") == (n, target_ids)


def test_a_round_of_hybrid_distillation_improves_held_out_acceptance(stories, smollm2, tmp_path):
    """The story model drafting for SmolLM2 on story traffic: one replay-gated round (hybrid distillation
    on 40 traces) raises held-out acceptance, fixed seed."""
    import json

    from online.config import TrainerConfig
    from online.trainer.round import ListSource, run_round
    from online.trainer.warmstart import answer_prompts
    from runtime.loader import DRAFTER_META
    from tests.conftest_eagle import story_prompts

    drafter_dir = tmp_path / "stories-xv"
    stories.model.save_pretrained(drafter_dir)
    stories.tokenizer.save_pretrained(drafter_dir)
    (drafter_dir / DRAFTER_META).write_text(json.dumps({"kind": "crossvocab", "version": "xv0"}))
    prompts = [smollm2.tokenizer(p).input_ids for p in story_prompts()[:50]]
    traces = answer_prompts(smollm2, prompts, 40)
    for i, t in enumerate(traces):
        t.request_id = f"s{i}"
    window = ListSource(traces, holdout_fraction=0.2).window()
    cfg = TrainerConfig(steps=40, batch_size=8, lr=3e-3, ce_weight=1.0, promote_margin=0.05, seed=0)
    res = run_round(window, drafter_dir, tmp_path / "work", cfg, champion_version="1", target=smollm2)
    assert res.promoted, res.reason
    assert res.candidate.mean_acceptance_length >= res.champion.mean_acceptance_length + 0.05
    assert json.loads((res.candidate_dir / DRAFTER_META).read_text())["kind"] == "crossvocab"


def test_bridge_is_maintained_from_the_stream_and_replicas_converge(tokenizers_pair, tmp_path):
    """The bridge is a materialised view of the trace stream like the suffix cache: the daemon's
    maintainer snapshots it, a replica that served some requests (written through) and one that
    only tailed end byte-identical, a replica starting from the snapshot (which holds no tokenizers)
    rebuilds a working bridge, and tenants stay apart."""
    from online.cache import CacheMaintainer, new_bridge
    from online.config import CacheConfig
    from online.stream.memory import MemoryStream
    from runtime.trace import RequestTrace

    t_tok, d_tok = tokenizers_pair
    t = Codec(t_tok)
    texts = [s + f" number {i % 7}" for i, s in enumerate(CORPUS[:40])]
    ts = [RequestTrace(request_id=f"r{i}", prompt_ids=[1], output_ids=t.encode(s), steps=[], target_model="t",
                       drafter_version="-", tag="a" if i % 4 else "b") for i, s in enumerate(texts)]

    def fresh():
        return new_bridge(CacheConfig(max_sequences=30), t_tok, d_tok)

    stream = MemoryStream()
    sink = stream.sink()
    main = CacheMaintainer.resume(stream.source("bridge-main"), tmp_path / "snaps", fresh, snapshot_every_n=25)
    serving = CacheMaintainer.resume(stream.source("bridge-serving"), tmp_path / "none1", fresh)
    tailing = CacheMaintainer.resume(stream.source("bridge-tailing"), tmp_path / "none2", fresh)
    for tr in ts[::5]:  # what this replica served: written through when the request ended
        serving.cache.write_through(tr.request_id, tr.output_ids, tr.tag)
    assert serving.cache.num_pending == len(ts[::5]) and serving.cache.mappings("a") > 0
    def drain(m):
        while m.cache.stream_offsets.get(0, 0) < len(stream):
            m.step(timeout_s=0.5)

    for tr in ts[:25]:
        sink.emit(tr)
    drain(main)  # snapshots at 25 traces
    late = CacheMaintainer.resume(stream.source("bridge-late"), tmp_path / "snaps", fresh)
    assert late.cache.ready and late.cache.stream_offsets == {0: 25} and late.cache.mappings("a") > 0
    for tr in ts[25:]:
        sink.emit(tr)
    for m in (main, serving, tailing, late):
        drain(m)
    assert main.stats.snapshots == 1 and serving.stats.confirmed == len(ts[::5]) and serving.cache.num_pending == 0
    assert serving.cache.snapshot() == tailing.cache.snapshot() == late.cache.snapshot() == main.cache.snapshot()
    assert late.cache.mappings("a") == main.cache.mappings("a") > 5
    # tenant scoping: b's bridge holds only b's traffic
    only_b = fresh()
    for tr in ts:
        if tr.tag == "b":
            only_b.add_sequence(tr.output_ids, "b")
    assert main.cache.mappings("b") == only_b.mappings("b") < main.cache.mappings("a")


def test_the_daemon_maintains_the_bridge_and_a_serving_replica_drafts_through_it(stories, smollm2, tmp_path):
    """`cache.bridge_drafter` set: `livedraft daemon --target T` maintains that drafter's vocabulary
    bridge from the stream (snapshots on drain), and what `serve --drafter-kind crossvocab` opens —
    a replica from the snapshot, tailing the stream — holds the same bridge and feeds the drafter."""
    import uuid

    from online.cache import open_replica_cache
    from online.cache.maintainer import bridge_factory
    from online.config import CacheConfig, Config, ConfigError, StreamConfig
    from online.daemon import Daemon
    from online.stream import open_sink
    from runtime.drafters.factory import DrafterConfig, build_drafter
    from runtime.trace import RequestTrace
    from tests.polling import wait_for

    cfg = Config(data_dir=str(tmp_path), stream=StreamConfig(kind="sql"),
                 cache=CacheConfig(bridge_drafter=str(stories.path)))
    with pytest.raises(ConfigError, match="--target"):
        Daemon(cfg, trainer=False)
    daemon = Daemon(cfg, target=smollm2, trainer=False)
    assert daemon.bridge is not None and daemon.bridge.cache.ready
    daemon.start()
    sink = open_sink(cfg)
    texts = [f"Once upon a time, there was a little {w} who loved to play in the park with a red ball."
             for w in ("girl", "boy", "dog", "cat", "bird", "girl", "boy", "dog")]
    try:
        for i, s in enumerate(texts):
            sink.emit(RequestTrace(request_id=f"r{i}-{uuid.uuid4().hex[:6]}", prompt_ids=[1],
                                   output_ids=smollm2.tokenizer(s).input_ids, steps=[], target_model="t",
                                   drafter_version="-"))
        assert sink.flush(10)
        wait_for(lambda: daemon.bridge.cache.num_sequences == len(texts), 30, "the bridge to take every trace")
    finally:
        sink.close()
        daemon.stop(30)
    assert list((tmp_path / "cache").glob("bridge-*.snap"))
    learned = daemon.bridge.cache.mappings()
    assert learned > 5
    replica = open_replica_cache(cfg, fresh=bridge_factory(cfg, smollm2.tokenizer), start=False)
    try:
        assert replica.cache.ready and replica.cache.num_sequences == len(texts)
        assert replica.cache.snapshot() == daemon.bridge.cache.snapshot()
        drafter = build_drafter(DrafterConfig(kind="crossvocab", path=str(stories.path), cache=replica.cache), smollm2)
        assert drafter.bridge is replica.cache
    finally:
        replica.source.close()
