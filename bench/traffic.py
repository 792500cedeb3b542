"""Benchmark traffic: built-in prompt pools, the target's greedy outputs, and exact fast replay.

- `prompt_pool(domain, n, seed)`: chat prompts from small built-in templates
  (stories, Python code, instructions, and a general mix).
- `greedy_traffic(target, prompts, ...)`: the target's own greedy completions,
  generated in padded batches, with the target's top-k logprobs (temperature 1)
  at every output position: everything a served trace would carry.
- `teacher_forced_replay(drafter, traffic, k)`: what serving that traffic with
  a model drafter at fixed draft length k and greedy verification would have
  measured, from ONE teacher-forced drafter forward per request. Exact for
  greedy: a draft token is only ever reached when every earlier draft token was
  accepted, i.e. equal to the logged output, so the drafter's proposal at output
  position i is its argmax given the logged prefix. The step loop then follows
  the engine (k capped at max_new_tokens - len(output) - 1; the first token comes
  from prefill). Equal to `online.replay.engine.replay_traces` step for step up to float
  rounding of batched vs incremental forwards (tests/test_bench_traffic.py).
- `served_trace(...)`: the RequestTrace the engine would have logged serving
  that request with that drafter: steps, and the target's top-k soft labels
  at each rejected position (what online distillation learns from).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from online.commands.generate import encode
from runtime.drafters.model import ModelDrafter
from runtime.loader import LoadedModel
from runtime.stats import RequestStats
from runtime.trace import RequestTrace, StepRecord

log = logging.getLogger(__name__)

_CHARACTERS = ["a shy dragon", "a little robot", "an old fisherman", "a curious cat", "two best friends",
               "a lonely lighthouse keeper", "a brave mouse", "a girl named Mia", "a boy named Sam",
               "a talking tree", "a lost puppy", "a young wizard", "a grumpy bear", "a tiny snail",
               "a clumsy giraffe", "a retired pirate", "a sleepy owl", "a girl named Priya", "an old clockmaker",
               "a family of rabbits"]
_EVENTS = ["finds a hidden door in the forest", "learns to share", "wants to see the sea for the first time",
           "is afraid of the dark", "makes a new friend at school", "loses a favourite toy",
           "helps a bird fix its nest", "plants a magic seed", "goes on a trip to the moon",
           "bakes a cake for grandma", "gets lost in a big city", "wins a race by being kind",
           "finds a map in the attic", "has to cross a river during a storm", "builds a snowman that comes alive",
           "forgets a friend's birthday", "hears music coming from under the ground", "opens a small bakery",
           "must return a lost key", "learns to ride a bicycle"]
_CODE_TASKS = ["returns the n-th Fibonacci number", "checks whether a string is a palindrome",
               "counts the vowels in a string", "reverses a linked list", "merges two sorted lists",
               "removes duplicates from a list while keeping order", "computes the factorial of n",
               "finds the largest element in a list", "checks whether a number is prime",
               "flattens a nested list", "converts Celsius to Fahrenheit", "counts word frequencies in a text",
               "returns the GCD of two integers", "sorts a list of dictionaries by a key",
               "reads a CSV file and returns its rows", "implements binary search",
               "validates an email address with a regular expression", "transposes a matrix",
               "computes the moving average of a list", "checks whether two strings are anagrams",
               "counts the lines in a text file", "returns the second largest number in a list",
               "converts a Roman numeral to an integer", "capitalises every word in a sentence",
               "computes the sum of the digits of an integer", "rotates a list by k positions",
               "checks whether brackets in a string are balanced", "returns all prime numbers below n",
               "groups words by their first letter", "computes the median of a list",
               "converts a dictionary to a JSON string", "finds the longest word in a sentence",
               "merges two dictionaries", "counts how often each character appears in a string",
               "returns the intersection of two lists", "generates the first n rows of Pascal's triangle",
               "checks whether a year is a leap year", "splits a list into chunks of size n",
               "computes the dot product of two vectors", "removes all whitespace from a string"]
_CODE_FORMS = ["Write a Python function that {t}.", "Write a Python function that {t}. Add a docstring.",
               "Implement in Python a function that {t}, with type hints.",
               "Show Python code for a function that {t}, and a short example of calling it.",
               "Write a short Python function that {t} and explain how it works.",
               "Give me a Python one-function solution that {t}."]
_HOWTO = ["make a cup of tea", "change a flat bicycle tyre", "prepare for a job interview", "start a vegetable garden",
          "clean a laptop keyboard", "write a good cover letter", "learn a new language",
          "plan a weekend trip", "set up a budget", "fall asleep faster", "cook rice on the stove",
          "organise a small desk", "back up the photos on a phone", "improve handwriting", "train for a 5 km run",
          "make pancakes", "repot a house plant", "write a thank-you note", "reduce stress before an exam",
          "wash a wool sweater", "save money on groceries", "prepare a short presentation", "care for a new puppy",
          "paint a room", "make a simple website", "start journaling", "choose a good password",
          "tie a tie", "make friends in a new city", "keep a sourdough starter alive"]
_INSTR_FORMS = ["Give step-by-step instructions to {t}.", "How do I {t}? Answer with numbered steps.",
                "Explain briefly how to {t}.", "List the steps to {t}.", "What is the easiest way to {t}?",
                "I want to {t}. Where should I start?"]
_TOPICS = ["photosynthesis", "how vaccines work", "the water cycle", "black holes", "inflation", "the internet",
           "machine learning", "the French revolution", "plate tectonics", "climate change", "DNA",
           "supply and demand", "the immune system", "electric cars", "the solar system", "democracy",
           "the Roman empire", "how airplanes fly", "volcanoes", "the printing press", "antibiotics",
           "renewable energy", "the human brain", "coral reefs", "how bread rises", "the moon landing",
           "earthquakes", "the stock market", "rainbows", "honey bees", "the Great Wall of China", "recycling",
           "how batteries work", "the Renaissance", "deserts", "GPS", "sleep", "the ocean tides", "music theory",
           "the Olympic games", "dinosaurs", "clouds", "cryptography", "the periodic table", "rainforests",
           "how the heart works", "the industrial revolution", "magnets", "glaciers", "human evolution"]
_GENERAL_FORMS = ["Explain {t} in simple terms.", "Write a paragraph about {t}.", "What are three facts about {t}?",
                  "Summarise what is known about {t} for a child.", "Why does {t} matter?",
                  "Give a short introduction to {t}.", "What is a common misconception about {t}?",
                  "Describe {t} in two or three sentences."]

DOMAINS = ("stories", "code", "instructions", "topics", "general")


def start_run(args: argparse.Namespace) -> tuple[Path, Path]:
    """Common bench start: log to stderr, set torch's thread count (`args.threads`; 0 keeps
    torch's default), and give a fresh work directory beside `args.out`. Returns (out, work)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    work = out.parent / f".{out.name}-work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    return out, work


THREADS_HELP = "torch CPU threads (1 avoids OpenMP spin contention on a shared box; 0: torch default)"


def prompt_pool(domain: str, n: int, seed: int = 0) -> list[str]:
    """`n` chat prompts of one domain (deterministic in `seed`), all distinct while n is at most
    the pool's size (stories 400, code 240, instructions 180, topics 400, general 750)."""
    if domain not in DOMAINS:
        raise ValueError(f"unknown domain {domain!r}: choose one of {DOMAINS}")
    if domain == "stories":
        pool = [f"Write a short story about {c} who {e}." for c in _CHARACTERS for e in _EVENTS]
    elif domain == "code":
        pool = [f.format(t=t) for f in _CODE_FORMS for t in _CODE_TASKS]
    elif domain == "instructions":
        pool = [f.format(t=t) for f in _INSTR_FORMS for t in _HOWTO]
    elif domain == "topics":  # explanations of general topics only
        pool = [f.format(t=t) for f in _GENERAL_FORMS for t in _TOPICS]
    else:
        pool = [f.format(t=t) for f in _GENERAL_FORMS for t in _TOPICS] + prompt_pool("stories", 150, seed) \
            + prompt_pool("code", 100, seed) + prompt_pool("instructions", 100, seed)
    rng = random.Random(f"{domain}-{seed}")
    rng.shuffle(pool)
    if n > len(pool):
        log.warning("prompt pool %r has %d distinct prompts: %d requested, so some repeat", domain, len(pool), n)
    return [pool[i % len(pool)] for i in range(n)]


# What a user turn of each domain starts with when the target writes the prompts itself
# (`written_pool`): the target continues each opener, so the prompts stay in their domain without
# a template a drafter could learn instead of the domain.
OPENERS = {
    # six per domain: a narrow opener repeats itself within ~100 prompts of a 135M target
    "stories": ("Write a short story about", "Tell me a story in which", "Write a bedtime story for",
                "Write a fairy tale about", "Can you write a funny story about", "Write a story for children where"),
    "code": ("Write a Python function that", "Write a Python program that", "How do I write Python code to",
             "Write a Python class that", "In Python, how can I", "Write a Python script that"),
    "instructions": ("How do I", "Give me step-by-step instructions to", "What is the easiest way to",
                     "What are the steps to", "Can you explain how to", "What should I do to"),
    "topics": ("Explain", "What is", "Why does"),
}
OPENERS["general"] = tuple(o for d in ("stories", "code", "instructions", "topics") for o in OPENERS[d][:1])


def written_pool(target: LoadedModel, domain: str, n: int, seed: int = 0) -> list[str]:
    """`n` distinct chat prompts of one domain written by the chat target itself: its user turns
    (Magpie) begun with the domain's openers in turn, sampled at temperature 1 (seeded). Unlike
    `prompt_pool`, as many as asked for, none from a template."""
    from online.trainer.warmstart import synthesize_prompts

    if domain not in OPENERS:
        raise ValueError(f"unknown domain {domain!r}: choose one of {tuple(OPENERS)}")
    openers = OPENERS[domain]
    per = [n // len(openers) + (i < n % len(openers)) for i in range(len(openers))]
    out: list[str] = []
    t0 = time.perf_counter()
    for i, (opener, m) in enumerate(zip(openers, per, strict=True)):
        if m:
            out += synthesize_prompts(target, m, opener=opener, seed=seed * 1009 + i, max_prompt_tokens=64)
            log.info("wrote %d of %d %s prompts (%.0fs)", len(out), n, domain, time.perf_counter() - t0)
    rng = random.Random(f"{domain}-written-{seed}")
    rng.shuffle(out)
    return out


def chat_ids(target: LoadedModel, prompt: str) -> list[int]:
    """`prompt` as a user turn in the target's chat template (as `livedraft generate --chat`)."""
    return encode(target.tokenizer, prompt, chat=True)


@dataclass
class Request:
    """One greedy request of the benchmark traffic and the target's answer."""

    prompt_ids: list[int]
    output_ids: list[int]
    max_new_tokens: int
    finish_reason: str  # "stop" or "length"
    topk_ids: list[list[int]] = field(default_factory=list)  # per output position
    topk_logprobs: list[list[float]] = field(default_factory=list)
    tag: str | None = None


def segments(traffic: list[Request], domains: list[str]) -> dict[str, tuple[int, int]]:
    """Each domain's requests [a, b) in the stream (the domains follow one another)."""
    bounds, start = {}, 0
    for d in domains:
        n = sum(1 for r in traffic if r.tag == d)
        bounds[d] = (start, start + n)
        start += n
    return bounds


def served_tail(bounds: dict[str, tuple[int, int]], n: int) -> dict[str, tuple[int, int]]:
    """Per segment [a, b), the requests [b - n, b) on which an online bench times the version that
    served request b - n (n at most the segment's length). A round runs after a block and its candidate
    serves from the next block on, so that version and every round before it trained and were gated
    on requests before b - n only: none of the timed prompts."""
    return {d: (max(a, b - n), b) for d, (a, b) in bounds.items()}


def cached_requests(cache: Path, key: dict, make: Callable[[], list[Request]]) -> list[Request]:
    """The requests stored in `cache` under `key`; when the file is missing or its key differs,
    `make()`'s, stored there first."""
    if cache.exists():
        data = json.loads(cache.read_text())
        if data.get("key") == key:
            return [Request(**r) for r in data["requests"]]
    out = make()
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"key": key, "requests": [r.__dict__ for r in out]}))
    return out


@torch.inference_mode()
def greedy_traffic(
    target: LoadedModel, prompts: Sequence[list[int]], max_new_tokens: int, *, batch_size: int = 16,
    topk: int = 8, tag: str | None = None,
) -> list[Request]:
    """The target's greedy completions of `prompts` (left-padded batches) with top-k logprobs per position."""
    model, eos = target.model, target.eos_ids
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else min(eos)
    out: list[Request] = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, p in enumerate(chunk):
            ids[b, width - len(p):] = torch.tensor(p)
            mask[b, width - len(p):] = 1
        gen = model.generate(ids.to(model.device), attention_mask=mask.to(model.device), do_sample=False,
                             max_new_tokens=max_new_tokens, pad_token_id=pad, output_logits=True,
                             return_dict_in_generate=True)
        logits = torch.stack(gen.logits, dim=1).float()  # [B, steps, V]
        top = torch.log_softmax(logits, dim=-1).topk(topk, dim=-1)
        for b, p in enumerate(chunk):
            toks = gen.sequences[b, width:].tolist()
            end = next((j + 1 for j, t in enumerate(toks) if t in eos), None)
            toks = toks[:end] if end else toks[:max_new_tokens]
            out.append(Request(list(p), toks, max_new_tokens, "stop" if end else "length",
                               top.indices[b, : len(toks)].tolist(), top.values[b, : len(toks)].tolist(), tag))
    return out


@torch.inference_mode()
def drafter_predictions(drafter: ModelDrafter, traffic: Sequence[Request], batch_size: int = 16) -> list[list[int]]:
    """The drafter's greedy token (target ids) at every output position, teacher-forced on the logged prefix."""
    model = drafter.model
    preds: list[list[int]] = []
    for i in range(0, len(traffic), batch_size):
        chunk = traffic[i : i + batch_size]
        seqs = [r.prompt_ids + r.output_ids[:-1] for r in chunk]
        width = max(len(s) for s in seqs)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, s in enumerate(seqs):  # right padding: causal attention keeps real positions exact
            ids[b, : len(s)] = torch.tensor(s)
            mask[b, : len(s)] = 1
        logits = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).logits  # [B, T, V']
        for b, r in enumerate(chunk):
            rows = logits[b, len(r.prompt_ids) - 1 : len(r.prompt_ids) - 1 + len(r.output_ids)]
            if drafter.kept_ids is not None:
                best = drafter.kept_ids[rows.argmax(-1)]
            else:
                best = rows[:, : drafter.target_vocab_size].argmax(-1)
            preds.append(best.tolist())
    return preds


def simulate_steps(req: Request, pred: list[int], k: int) -> list[tuple[int, int, int]]:
    """(pos, drafted, accepted) per verify step, as the engine would run them at fixed k, greedy."""
    n, steps, p = len(req.output_ids), [], 1  # output[0] comes from prefill
    while p < n:
        kk = min(k, max(req.max_new_tokens - p - 1, 0))
        a = 0
        while a < kk and p + a < n and pred[p + a] == req.output_ids[p + a]:
            a += 1
        steps.append((p, kk, a))
        p += a + 1
    return steps


def request_stats(req: Request, steps: list[tuple[int, int, int]]) -> RequestStats:
    st = RequestStats(prompt_tokens=len(req.prompt_ids), output_tokens=len(req.output_ids))
    for _, drafted, accepted in steps:
        st.record_step(drafted, accepted)
    return st


def teacher_forced_replay(drafter: ModelDrafter, traffic: Sequence[Request], k: int) -> list[RequestStats]:
    """Per-request acceptance statistics of serving `traffic` with `drafter` at fixed k (greedy)."""
    preds = drafter_predictions(drafter, traffic)
    return [request_stats(r, simulate_steps(r, p, k)) for r, p in zip(traffic, preds, strict=True)]


def served_trace(req: Request, pred: list[int], k: int, request_id: str, drafter_version: str,
                 target_model: str) -> RequestTrace:
    """The trace serving `req` with this drafter logs: steps, soft labels at each rejected position.
    `drafted` holds the draft up to its first rejected token (later draft tokens are never reached)."""
    steps = []
    for pos, drafted, accepted in simulate_steps(req, pred, k):
        rec = StepRecord(pos, pred[pos : pos + min(accepted + 1, drafted)], "model", accepted)
        rejected = pos + accepted
        if accepted < drafted and rejected < len(req.output_ids):
            rec.topk_ids, rec.topk_logprobs = req.topk_ids[rejected], req.topk_logprobs[rejected]
        steps.append(rec)
    return RequestTrace(request_id=request_id, prompt_ids=req.prompt_ids, output_ids=req.output_ids, steps=steps,
                        target_model=target_model, drafter_version=drafter_version,
                        max_new_tokens=req.max_new_tokens, finish_reason=req.finish_reason, tag=req.tag)


def full_label_trace(req: Request, request_id: str, target_model: str) -> RequestTrace:
    """A trace with the target's soft labels at every output position (offline distillation data)."""
    steps = [StepRecord(i, [], "none", 0, req.topk_ids[i], req.topk_logprobs[i]) for i in range(len(req.output_ids))]
    return RequestTrace(request_id=request_id, prompt_ids=req.prompt_ids, output_ids=req.output_ids, steps=steps,
                        target_model=target_model, drafter_version="none", max_new_tokens=req.max_new_tokens,
                        finish_reason=req.finish_reason, tag=req.tag)
