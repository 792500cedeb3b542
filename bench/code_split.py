"""Prompt files for the llama-server bench's code traffic: train on some code tasks, measure on others.

The code pool of `bench.traffic` is 40 Python tasks x 6 phrasings. This writes, into OUT:

- `train.txt`: 160 prompts, 32 tasks in 5 of the 6 phrasings (what a head is trained on);
- `calib.txt`: 6 of those 32 tasks in the sixth phrasing (the version's acceptance for the cost rule);
- `eval-seen-tasks.txt`: the other 26 in the sixth phrasing (traffic like the training traffic:
  its tasks, never its prompts);
- `eval-unseen-tasks.txt`: the 8 held-out tasks in all 6 phrasings (the same domain, new tasks).

    python -m bench.code_split --out /tmp/code-split
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from bench.traffic import _CODE_FORMS, _CODE_TASKS


def split(seed: int = 7) -> dict[str, list[str]]:
    rng = random.Random(seed)
    tasks = list(_CODE_TASKS)
    rng.shuffle(tasks)
    unseen, seen = tasks[:8], tasks[8:]
    held_form = _CODE_FORMS[rng.randrange(len(_CODE_FORMS))]
    train = [f.format(t=t) for f in _CODE_FORMS if f != held_form for t in seen]
    unseen_prompts = [f.format(t=t) for f in _CODE_FORMS for t in unseen]
    other_form = [held_form.format(t=t) for t in seen]
    for part in (train, unseen_prompts, other_form):
        rng.shuffle(part)
    return {"train": train, "calib": other_form[:6], "eval-seen-tasks": other_form[6:],
            "eval-unseen-tasks": unseen_prompts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, prompts in split(args.seed).items():
        (out / f"{name}.txt").write_text("\n".join(prompts) + "\n")
        print(f"{out / name}.txt: {len(prompts)} prompts")


if __name__ == "__main__":
    main()
