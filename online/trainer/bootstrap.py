"""The first champion of a fresh data directory (`livedraft up`, `livedraft demo`): an EAGLE-3 head
warm-started on built-in prompts the target answers, or a drafter derived from the target's first
layers. Both are built once and cached."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

from online.config import Config, TrainerConfig

WARM_START_PROMPTS = 96  # built-in prompts the target answers for an initial eagle head
WARM_START_TOKENS = 48  # the length of each answer
WARM_START_HELDOUT = 8  # answers kept out of training for the held-out acceptance it prints
PROMPT_SEED = 99  # which built-in prompts, in which order (warm_start_prompts)
RECIPE_FILE = "warm_start_recipe.json"  # beside the cached head (and its warm_start.json curve): its recipe


def warm_start_config(minutes: float) -> TrainerConfig:
    """The trainer settings of the initial eagle head: `minutes` of training, the rest the trainer's
    defaults but for a warm start's learning rate, CE mix and warmup."""
    return TrainerConfig(steps=1_000_000, max_seconds=minutes * 60, batch_size=8, lr=1e-3, ce_weight=0.2,
                         warmup_steps=20)


def warm_start_prompts(domains: list[str]) -> list[str]:
    """WARM_START_PROMPTS distinct built-in prompts of `domains` (as evenly as their lists allow),
    in a seeded shuffled order, so the last WARM_START_HELDOUT (held out) span the domains and
    repeat no training prompt."""
    from online.traffic.prompts import DOMAINS

    rng = random.Random(PROMPT_SEED)
    pools = {d: rng.sample(DOMAINS[d], len(DOMAINS[d])) for d in domains}
    out: list[str] = []
    while len(out) < WARM_START_PROMPTS and any(pools.values()):
        for d in domains:  # one from each domain in turn, while it has prompts left
            if pools[d] and len(out) < WARM_START_PROMPTS:
                out.append(pools[d].pop())
    rng.shuffle(out)
    return out


def warm_start_answers(target: object, domains: list[str], progress: Callable[[int, int], None] | None = None
                       ) -> tuple[list, list]:
    """The warm start's data: the target's greedy answers (WARM_START_TOKENS each) to
    `warm_start_prompts(domains)` in its chat template, as (train, held out: the last
    WARM_START_HELDOUT). `progress(done, total)` runs as chunks of prompts are answered."""
    from online.traffic.prompts import chat_prompts
    from online.trainer.warmstart import answer_prompts

    texts = chat_prompts(target.tokenizer, warm_start_prompts(domains))
    done = 0

    def answered(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, len(texts))

    traces = answer_prompts(target, [target.tokenizer(t).input_ids for t in texts], WARM_START_TOKENS,
                            progress=answered)
    return traces[:-WARM_START_HELDOUT], traces[-WARM_START_HELDOUT:]


# trainer settings of the online rounds' gate and lineage, which a warm start never reads
ROUND_ONLY = ("promote_margin", "lineage", "replay_k", "holdout_fraction", "carry_optimizer", "feature_cache_mb")


def warm_start_recipe(domains: list[str], minutes: float) -> dict:
    """What a cached initial head depends on: its prompts, their answers' length and every trainer
    setting but the rounds' own (ROUND_ONLY), so a head built before the trainer's defaults changed is
    built again, not reused (a setting added to the trainer counts until it is named there)."""
    trainer = {k: v for k, v in dataclasses.asdict(warm_start_config(minutes)).items() if k not in ROUND_ONLY}
    recipe = {"prompts": WARM_START_PROMPTS, "distinct": True, "domains": domains, "prompt_seed": PROMPT_SEED,
              "answer_tokens": WARM_START_TOKENS, "heldout": WARM_START_HELDOUT, "trainer": trainer}
    return json.loads(json.dumps(recipe))  # as it reads back from its file (tuples as lists)


def initial_eagle_dir(cfg: Config, spec: str, target: object, *, minutes: float, avoid_domain: str | None = None
                      ) -> Path:
    """An EAGLE-3 head for target `spec`, warm-started on WARM_START_PROMPTS built-in prompts of the
    traffic domains (but `avoid_domain`, so a demo shows the loop learning that one) for `minutes`
    of training, cached under models.cache_dir/drafters with the recipe it was built with
    (`warm_start_recipe`); a cached head of another recipe is built again in its place."""
    from online.traffic.prompts import DOMAINS
    from online.trainer.warmstart import warm_start

    domains = [d for d in sorted(DOMAINS) if d != avoid_domain]
    out = (Path(cfg.models.cache_dir).expanduser() / "drafters"
           / f"{Path(spec).name}-eagle-{'-'.join(domains)}-{WARM_START_PROMPTS}p-{minutes:g}min")
    recipe = warm_start_recipe(domains, minutes)
    if (out / "config.json").is_file():
        cached = _read_recipe(out / RECIPE_FILE)
        if cached == recipe:
            return out
        changed = _changed(cached, recipe) if cached is not None else ["no recipe file: built by an older version"]
        print(f"the cached warm start {out} was built with other settings ({', '.join(changed)}); building it again",
              flush=True)
    print(f"warm-starting an EAGLE-3 head for {spec} on {WARM_START_PROMPTS} prompts ({', '.join(domains)}) for "
          f"{minutes:g} min of training into {out} (once) ...", flush=True)

    def answered(done: int, total: int) -> None:
        print(f"warm start: the target answered {done}/{total} prompts", flush=True)

    train, heldout = warm_start_answers(target, domains, progress=answered)
    tmp = out.parent / f".{out.name}-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    res = warm_start(target, train, heldout, tmp, warm_start_config(minutes), eval_every=0,
                     version=f"{Path(spec).name}-eagle")
    (tmp / RECIPE_FILE).write_text(json.dumps(recipe, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"warm start: {res.steps} steps, held-out mean acceptance length "
          f"{res.curve[-1].heldout_mean_acceptance_length:.2f}", flush=True)
    return out


def _read_recipe(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _changed(old: dict, new: dict, prefix: str = "") -> list[str]:
    """The keys whose values differ between two recipes, dotted (`trainer.lr`)."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changed(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


def initial_drafter_dir(cfg: Config, spec: str, layers: int, target: Callable[[], object]) -> Path:
    """The drafter derived from target `spec` (first `layers` layers), cached under
    <data_dir>/drafters/<name>-<layers>l; `target()` gives the loaded target, called only to derive."""
    from runtime.derive import derive_drafter

    out = cfg.data_path / "drafters" / f"{Path(spec).name}-{layers}l"
    if not (out / "config.json").is_file():
        print(f"deriving a {layers}-layer drafter from {spec} into {out} ...", flush=True)
        derive_drafter(target(), layers, out)
    return out
