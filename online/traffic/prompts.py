"""Built-in prompt pools per traffic domain, for `livedraft traffic`, `livedraft up --demo` and benches.

Each pool is a cross product of templates and slot values, so a domain has hundreds of
distinct prompts that still share its style: traffic from one domain is repetitive
enough for a drafter to learn, and a switch of domain is a visible distribution shift.
"""

from __future__ import annotations

import itertools
import random

_STORY_WHO = ["a little robot", "a brave girl named Lily", "a sleepy cat", "an old fisherman", "a tiny dragon",
              "a curious boy named Tim", "a friendly bear", "a lost puppy", "a wise owl", "a young princess"]
_STORY_WHAT = ["who wanted to see the sea", "who found a shiny key", "who was afraid of the dark",
               "who lost a red ball", "who wanted to fly", "who made a new friend", "who could not sleep",
               "who found a secret door"]
_STORY_TEMPLATES = ["Once upon a time, there was {who} {what}.", "Write a short story about {who} {what}.",
                    "Tell a bedtime story for children about {who} {what}."]

_CODE_TASKS = ["returns the n-th Fibonacci number", "checks whether a string is a palindrome",
               "reverses a linked list", "counts the words in a text", "merges two sorted lists",
               "computes the factorial of n", "removes duplicates from a list", "finds the largest element of a list",
               "converts Celsius to Fahrenheit", "checks whether a number is prime"]
_CODE_TEMPLATES = ["Write a Python function that {task}.", "Write a Python function that {task}, with a docstring.",
                   "Implement in Python a function that {task} and explain it briefly."]

_INSTR_TASKS = ["make a cup of tea", "plant a tree", "learn a new language", "save money each month",
                "prepare for a job interview", "write a good email", "improve your sleep", "start running",
                "cook rice", "organise a small party"]
_INSTR_TEMPLATES = ["Explain how to {task} in three steps.", "Give me five tips to {task}.",
                    "What is the best way to {task}? Answer briefly."]

_JSON_THINGS = ["a book", "a city", "a car", "a movie", "a restaurant", "a planet", "a song", "a laptop",
                "a dog breed", "a football team"]
_JSON_FIELDS = ["year and rating", "country and population", "price and colour", "author and genre"]
_JSON_TEMPLATES = ["Return a JSON object describing {thing} with the fields name, {fields}.",
                   "Describe {thing} as JSON with keys name, {fields}. Output only JSON."]


def _pool(templates: list[str], **slots: list[str]) -> list[str]:
    keys = list(slots)
    return [t.format(**dict(zip(keys, values, strict=True)))
            for t in templates for values in itertools.product(*(slots[k] for k in keys))]


DOMAINS: dict[str, list[str]] = {
    "stories": _pool(_STORY_TEMPLATES, who=_STORY_WHO, what=_STORY_WHAT),
    "code": _pool(_CODE_TEMPLATES, task=_CODE_TASKS),
    "instructions": _pool(_INSTR_TEMPLATES, task=_INSTR_TASKS),
    "json": _pool(_JSON_TEMPLATES, thing=_JSON_THINGS, fields=_JSON_FIELDS),
}


def prompts_for(domain: str, n: int, seed: int = 0) -> list[str]:
    """`n` prompts of `domain`, sampled with replacement (deterministic in `seed`).
    Raises ValueError for an unknown domain."""
    if domain not in DOMAINS:
        raise ValueError(f"unknown traffic domain {domain!r}: choose one of {', '.join(DOMAINS)}")
    rng = random.Random(seed)
    return [rng.choice(DOMAINS[domain]) for _ in range(n)]


def has_chat_template(tokenizer: object) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_prompts(tokenizer: object, prompts: list[str]) -> list[str]:
    """Prompts rendered through the target's own chat template (as text; the server tokenizes),
    or unchanged for a base model without one."""
    if not has_chat_template(tokenizer):
        return prompts
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                          add_generation_prompt=True) for p in prompts]
