"""The suite's own trained test model: a stories260K-shaped Llama the tests train themselves.

A fresh clone has no `../shared`, so the tests cannot rely on the real stories260K. This module
builds a model of the same shape (5 layers, hidden 64, 8 heads / 4 KV heads, a 512-token
SentencePiece vocabulary with byte fallback, BOS-prefixed documents and no EOS, so it never stops
early) and trains it on text the project writes itself: short children's stories from a grammar,
plus the repetitive JSON / code / agent workloads of devkit/workloads.py. The result has a real,
peaked distribution: greedy continuations are fluent and partly predictable, so suffix, n-gram,
eagle and distillation tests see acceptance, while a derived 2-layer drafter is still weak.

Deterministic (seeded corpus, tokenizer and training, a fixed thread count) and cached under
~/.cache/livedraft/test-models/ (LIVEDRAFT_TEST_MODELS overrides), keyed by this file's hash, so
it is trained once per machine (~45 s on 2 cores) and rebuilt only when the recipe changes.
Concurrent builders (pytest-xdist workers, parallel CI jobs) serialise on a file lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import random
import shutil
import time
from pathlib import Path

import torch

from devkit.workloads import agent_turns, code_edit, templated_json

NAME = "tiny-stories"
VOCAB = 512
SEED = 0
STEPS = 240
BATCH, SEQ = 32, 64
LR = 1e-2
THREADS = 2  # measured: 0.18 s a step on 2 threads, 0.23 s on 1

NAMES = ["Lily", "Tom", "Max", "Sue", "Ben", "Mia", "Sam", "Anna", "Tim", "Zoe", "Lucy", "Jack",
         "Emma", "Leo", "Kate", "Bob", "Amy", "Joe", "Rose", "Dan"]
THINGS = ["a red ball", "a big dog", "a little cat", "a toy car", "a pretty flower", "a tall tree",
          "a shiny stone", "a blue kite", "a small bird", "a funny hat", "a big box", "a green frog",
          "a new book", "a yellow duck", "a soft bear", "a cake"]
PLACES = ["the park", "the garden", "the forest", "the beach", "school", "the house", "the shop",
          "the town", "the river", "the farm"]
ADJS = ["happy", "sad", "kind", "brave", "little", "curious", "shy", "silly", "big", "good"]
FEELINGS = ["happy", "sad", "scared", "excited", "angry", "proud", "tired", "surprised"]
ACTS = ["play with", "look at", "share", "find", "help", "hug", "chase", "catch", "draw", "clean"]
HOBBIES = ["play outside", "run and jump", "sing songs", "read books", "build towers", "paint",
           "dance", "swim", "climb trees", "help mom"]


def _story(rng: random.Random) -> str:
    """A short TinyStories-like story from a small grammar (several shapes, many fillers)."""
    n, m = rng.sample(NAMES, 2)
    thing, place, adj = rng.choice(THINGS), rng.choice(PLACES), rng.choice(ADJS)
    pr = rng.choice(["He", "She"])
    kid = "girl" if pr == "She" else "boy"
    opening = rng.choice([
        f"Once upon a time, there was a {adj} {rng.choice(['girl', 'boy', 'cat', 'dog'])} named {n}.",
        f"Once upon a time, there was a little {kid} named {n}. {pr} was a {adj} {kid} who loved to "
        f"{rng.choice(HOBBIES)}.",
        f"Once upon a time, in a small town, there lived a {adj} {kid} named {n}.",
        f"{n} had {thing}. One day, {n} wanted to go to {place}.",
        f"Once upon a time, {n} found {thing}.",
        f"{n} and {m} went to {place}.",
        f"One day, {n} was in {place}.",
    ])
    middle = [
        f"{pr} liked to {rng.choice(HOBBIES)} in {place}.",
        f"One day, {n} saw {thing}.",
        f"{n} wanted to {rng.choice(ACTS)} it.",
        f'"Can I {rng.choice(ACTS)} it?" asked {n}.',
        f'"Yes, you can," said {m}.',
        f"{n} felt {rng.choice(FEELINGS)}.",
        f"They went to {rng.choice(PLACES)} together.",
        f"{m} said, \"Let's {rng.choice(HOBBIES)}!\"",
        f"{n} and {m} played all day.",
        "Then it started to rain, so they went home.",
        f"{m} was {rng.choice(FEELINGS)} because {thing} was gone.",
        f"{n} looked for {thing} in {rng.choice(PLACES)}.",
        f"{pr} was very {rng.choice(FEELINGS)} and wanted to {rng.choice(HOBBIES)}.",
        "One day, a big storm came and the wind was very strong.",
        f"{n} loved to explore and learn new things.",
        "The sun was shining and the birds were singing.",
        f"{n} asked {m}, \"Do you want to {rng.choice(HOBBIES)} with me?\"",
        f"{m} smiled and said, \"Thank you, {n}!\"",
        f"{n} had a lot of fun with {rng.choice(THINGS)}.",
    ]
    rng.shuffle(middle)
    ending = rng.choice([
        f"In the end, {n} and {m} were good friends.",
        f"From that day on, {n} always shared with {m}.",
        f"{n} learned to be {rng.choice(ADJS)} and kind.",
        f"They were very {rng.choice(FEELINGS)} and went to sleep.",
    ])
    return " ".join([opening, *middle[:rng.randint(3, 8)], ending])


def corpus(n_docs: int = 6000, seed: int = SEED) -> list[str]:
    """Documents: ~80% stories, the rest the repetitive JSON / code / agent workloads."""
    rng, docs = random.Random(seed), []
    for i in range(n_docs):
        r = rng.random()
        if r < 0.8:
            docs.append(_story(rng))
        elif r < 0.87:
            docs.append("".join(templated_json(rng, i)))
        elif r < 0.94:
            docs.append("".join(code_edit(rng, i)))
        else:
            docs.append("".join(p + o for p, o in agent_turns(rng, i, turns=3)[-1:]))
    return docs


def _recipe_key() -> str:
    import devkit.workloads

    src = Path(__file__).read_bytes() + Path(devkit.workloads.__file__).read_bytes()
    return hashlib.sha256(src + torch.__version__.encode()).hexdigest()[:12]


def cache_root() -> Path:
    env = os.environ.get("LIVEDRAFT_TEST_MODELS")
    return Path(env).expanduser() if env else Path("~/.cache/livedraft/test-models").expanduser()


def test_model_dir() -> Path:
    """The trained test model's directory, building it first if this machine has none yet."""
    root = cache_root()
    out = root / f"{NAME}-{_recipe_key()}"
    if (out / "model.safetensors").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it right now
        if not (out / "model.safetensors").is_file():
            tmp = root / f".{out.name}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            build(tmp)
            tmp.rename(out)
    return out


def _tokenizer(docs: list[str], out: Path):
    import sentencepiece as spm
    from transformers import LlamaTokenizer

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(docs), model_writer=model, vocab_size=VOCAB, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=1, max_sentence_length=8192, split_digits=True, minloglevel=2)
    (out / "tokenizer.model").write_bytes(model.getvalue())
    tok = LlamaTokenizer.from_pretrained(out, legacy=False, add_bos_token=True, add_eos_token=False)
    tok.save_pretrained(out)
    return tok


def build(out: Path) -> None:
    """Write the tokenizer, train the model (seeded, one thread) and save both to `out`."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    t0 = time.monotonic()
    out.mkdir(parents=True)
    docs = corpus()
    tok = _tokenizer(docs, out)
    ids = [t for d in tok(docs, add_special_tokens=False).input_ids for t in [1, *d]]
    data = torch.tensor(ids)

    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        torch.manual_seed(SEED)
        cfg = LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=172, num_hidden_layers=5,
            num_attention_heads=8, num_key_value_heads=4, head_dim=8, max_position_embeddings=512,
            bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True, rms_norm_eps=1e-5)
        model = LlamaForCausalLM(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, betas=(0.9, 0.95))
        gen = torch.Generator().manual_seed(SEED)
        model.train()
        for step in range(STEPS):
            lr = LR * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * (1 - step / STEPS))
            for g in opt.param_groups:
                g["lr"] = lr
            starts = torch.randint(0, len(data) - SEQ - 1, (BATCH,), generator=gen)
            x = torch.stack([data[s:s + SEQ] for s in starts.tolist()])
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        model.eval()
        model.save_pretrained(out, safe_serialization=True)
        GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0).save_pretrained(out)
    finally:
        torch.set_num_threads(threads)
    (out / "recipe.json").write_text(json.dumps({
        "name": NAME, "steps": STEPS, "batch": BATCH, "seq": SEQ, "lr": LR, "docs": len(docs),
        "tokens": len(ids), "final_loss": round(float(loss), 4), "build_s": round(time.monotonic() - t0, 1)}))
