"""The first champion of a fresh data directory (`livedraft up`, `livedraft demo`): an EAGLE-3 head
warm-started on built-in prompts the target answers, or a drafter derived from the target's first
layers. Both are built once and cached."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from online.config import Config, TrainerConfig

WARM_START_PROMPTS = 96  # built-in prompts the target answers for an initial eagle head


def initial_eagle_dir(cfg: Config, spec: str, target: object, *, minutes: float, avoid_domain: str | None = None
                      ) -> Path:
    """An EAGLE-3 head for target `spec`, warm-started on WARM_START_PROMPTS built-in prompts of the
    traffic domains (but `avoid_domain`, so a demo shows the loop learning that one) for `minutes`
    of training, cached under models.cache_dir/drafters."""
    from online.traffic.prompts import DOMAINS, chat_prompts, prompts_for
    from online.trainer.warmstart import answer_prompts, warm_start

    domains = [d for d in sorted(DOMAINS) if d != avoid_domain]
    out = (Path(cfg.models.cache_dir).expanduser() / "drafters"
           / f"{Path(spec).name}-eagle-{'-'.join(domains)}-{WARM_START_PROMPTS}p-{minutes:g}min")
    if (out / "config.json").is_file():
        return out
    per = WARM_START_PROMPTS // len(domains)
    texts = chat_prompts(target.tokenizer, [p for d in domains for p in prompts_for(d, per, seed=99)])
    print(f"warm-starting an EAGLE-3 head for {spec} on {len(texts)} prompts ({', '.join(domains)}) for "
          f"{minutes:g} min of training into {out} (once) ...", flush=True)
    done = [0]

    def answered(n: int) -> None:
        done[0] += n
        print(f"warm start: the target answered {done[0]}/{len(texts)} prompts", flush=True)

    traces = answer_prompts(target, [target.tokenizer(t).input_ids for t in texts], 48, progress=answered)
    tcfg = TrainerConfig(steps=1_000_000, max_seconds=minutes * 60, batch_size=8, lr=1e-3, ce_weight=0.2,
                         warmup_steps=20)
    tmp = out.parent / f".{out.name}-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    res = warm_start(target, traces[:-8], traces[-8:], tmp, tcfg, eval_every=0, version=f"{Path(spec).name}-eagle")
    tmp.rename(out)
    print(f"warm start: {res.steps} steps, held-out mean acceptance length "
          f"{res.curve[-1].heldout_mean_acceptance_length:.2f}", flush=True)
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
