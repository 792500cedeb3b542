"""Repetitive and open-ended workloads for comparing drafters.

The repetitive families are the traffic SuffixDecoding targets: templated JSON extraction,
repeated code edits with small variations, multi-turn agent loops whose turns reuse the
tool-call format and earlier observations. Each item is (prompt text, output text); traces
built from them are greedy "ground truth" for teacher-forced replay (online.replay), so a
drafter's acceptance on them is what serving that traffic with it would measure.

`HFPromptLookupDrafter` wraps transformers' own PromptLookupCandidateGenerator (what
`generate(prompt_lookup_num_tokens=k)` uses) behind our Drafter protocol, so HF prompt lookup
is scored on exactly the same traces and verify loop as our drafters.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

import torch

from runtime.drafters.base import Draft, DraftRow, RowwiseDrafter
from runtime.trace import RequestTrace

NAMES = ["Lily", "Tom", "Ben", "Sue", "Max", "Anna", "Sam", "Mia", "Tim", "Zoe"]
THINGS = ["cat", "dog", "ball", "tree", "cake", "boat", "bird", "car", "hat", "book"]
PLACES = ["park", "school", "garden", "house", "forest", "beach", "town", "shop"]


def templated_json(rng: random.Random, i: int) -> tuple[str, str]:
    name, thing, place, age = rng.choice(NAMES), rng.choice(THINGS), rng.choice(PLACES), rng.randint(3, 9)
    prompt = f"Story {i}: {name} is {age} years old and has a {thing} at the {place}. Give the facts as JSON."
    out = (f'{{"id": {i}, "name": "{name}", "age": {age}, "thing": "{thing}", '
           f'"place": "{place}", "happy": true, "source": "story"}}')
    return prompt, out


_CODE = """def count_{thing}s(items):
    total = 0
    for item in items:
        if item.kind == "{thing}":
            total += item.{field}
    return total
"""


def code_edit(rng: random.Random, i: int) -> tuple[str, str]:
    thing, field = rng.choice(THINGS), rng.choice(["size", "count", "weight"])
    new = rng.choice(["amount", "number", "value"])
    before = _CODE.format(thing=thing, field=field)
    after = before.replace(f"item.{field}", f"item.{new}").replace("total = 0", rng.choice(
        ["total = 0", "total = 0  # start at zero"]))
    return f"Rename the field {field} to {new}:\n{before}\nAnswer:\n", after


def agent_turns(rng: random.Random, i: int, turns: int = 4) -> list[tuple[str, str]]:
    """One agent episode: each turn's prompt is the transcript so far (so it repeats)."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    transcript = f"Task {i}: find where {name} left the {thing}.\n"
    out = []
    for t in range(turns):
        place = rng.choice(PLACES)
        step = (f"Thought: I should look for the {thing} in the {place}.\n"
                f"Action: search[{name} {thing} {place}]\n")
        out.append((transcript, step))
        seen = "found it" if t == turns - 1 else "nothing there"
        transcript += step + f"Observation: {seen} in the {place}.\n"
    return out


def open_ended(rng: random.Random, i: int) -> tuple[str, str]:
    """Free text with no cross-request template (the non-repetitive control)."""
    words = [rng.choice(NAMES + THINGS + PLACES + ["ran", "saw", "was", "big", "red", "and", "the"])
             for _ in range(rng.randint(20, 40))]
    return f"Write a story about {rng.choice(THINGS)}:", " ".join(words) + "."


def repetitive_pairs(n: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """n (family, prompt, output) items, interleaving the three repetitive families."""
    rng, items, i = random.Random(seed), [], 0
    while len(items) < n:
        items.append(("json", *templated_json(rng, i)))
        items.append(("code", *code_edit(rng, i)))
        items += [("agent", p, o) for p, o in agent_turns(rng, i)]
        i += 1
    return items[:n]


def traces_from_pairs(pairs: Iterable[tuple[str, str, str]], encode: Callable[[str], list[int]]) -> list[RequestTrace]:
    """Greedy traces (prompt ids, output ids, tag = family) from text pairs."""
    return [RequestTrace(request_id=f"w{i}", prompt_ids=encode(p), output_ids=out, steps=[],
                         target_model="workload", drafter_version="-", max_new_tokens=len(out), tag=tag)
            for i, (tag, p, o) in enumerate(pairs) for out in [encode(o)]]


class HFPromptLookupDrafter(RowwiseDrafter):
    """transformers' PromptLookupCandidateGenerator as a Drafter (reference baseline).

    HF's defaults: max_matching_ngram_size 2, the first (leftmost) match in the context.
    """

    def __init__(self, max_matching_ngram_size: int = 2, version: str = "hf-lookup") -> None:
        self.ngram = max_matching_ngram_size
        self.version = version
        self._live: set[str] = set()

    def begin(self, req_id: str, prompt_ids: list[int], *, tag: str | None = None) -> None:
        self._live.add(req_id)

    def propose_row(self, row: DraftRow) -> Draft:
        from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

        req_id, context_ids, max_tokens = row.req_id, row.context, row.max_tokens
        if req_id not in self._live:
            raise ValueError(f"request {req_id!r} was not begun")
        if max_tokens <= 0:
            return Draft([], "lookup")
        gen = PromptLookupCandidateGenerator(num_output_tokens=max_tokens, max_matching_ngram_size=self.ngram,
                                             max_length=len(context_ids) + max_tokens + 1)
        ids = torch.tensor([context_ids])
        cand, _ = gen.get_candidates(ids)
        return Draft(cand[0, len(context_ids):].tolist()[:max_tokens], "lookup")

    def end(self, req_id: str, output_ids: list[int] | None = None) -> None:
        self._live.discard(req_id)
