"""Offline warm start of an EAGLE-3 head: the target answers prompts (or the log supplies traces),
features are recomputed, the head is trained, and held-out acceptance is measured as it trains.

What `livedraft drafter train` and bench/train_eagle.py run. Held-out mean acceptance
length is exact teacher-forced replay (greedy traces) at draft length k, with the
features of the same teacher-forced target pass serving would have computed.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from online.config import TrainerConfig
from online.replay.engine import replay_traces
from online.trainer.common import NotEnoughData
from online.trainer.eagle import (
    choose_draft_vocab,
    init_head,
    make_examples,
    refresh_vocab,
    save_head,
    train_head,
    usable,
)
from online.trainer.features import FeatureExtractor, TargetPass
from runtime.adaptive import DraftLengthConfig
from runtime.drafters.eagle import EagleHead, FeatureDrafter, check_head_matches_target
from runtime.drafters.none import NoDrafter
from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine
from runtime.errors import LivedraftError
from runtime.loader import LoadedModel
from runtime.trace import RequestTrace

log = logging.getLogger(__name__)
T = TypeVar("T")


def answer_chunks(target: LoadedModel, prompts: Sequence[list[int]], max_new_tokens: int, *, batch: int = 16,
                  temperature: float = 0.0, seed: int = 0) -> Iterator[list[RequestTrace]]:
    """The target's answers (traces as serving logs them), `batch` requests decoded together,
    yielded four batches at a time in the prompts' order: greedy, or sampled at `temperature`
    (prompt i seeded with seed + i, so reproducible however many chunks a caller reads)."""
    engine = SpeculativeEngine.for_model(target, NoDrafter(), EngineConfig(max_batch=batch, topk_logprobs=0))
    for i in range(0, len(prompts), batch * 4):
        chunk = prompts[i : i + batch * 4]
        params = [SamplingParams(max_new_tokens, temperature, 1.0, None if temperature == 0 else seed + i + j)
                  for j in range(len(chunk))]
        yield [r.trace for r in engine.generate_batch(list(chunk), params)]


def answer_prompts(target: LoadedModel, prompts: Sequence[list[int]], max_new_tokens: int, *, batch: int = 16,
                   progress: Callable[[int], None] | None = None, temperature: float = 0.0,
                   seed: int = 0) -> list[RequestTrace]:
    """All of answer_chunks' answers; `progress(n)` after each chunk of n."""
    out: list[RequestTrace] = []
    for chunk in answer_chunks(target, prompts, max_new_tokens, batch=batch, temperature=temperature, seed=seed):
        out += chunk
        if progress is not None:
            progress(len(chunk))
    return out


def sampled_answers(target: LoadedModel, prompts: Sequence[list[int]], max_new_tokens: int, passes: int,
                    temperature: float, *, batch: int = 16,
                    progress: Callable[[int], None] | None = None) -> list[RequestTrace]:
    """`passes` more answers per prompt, sampled at `temperature` (pass n seeded with
    (n + 1) * 1_000_003, so every run with the same prompts draws the same answers): more
    training data for the same prompts, beside their greedy answers."""
    if passes and not temperature > 0:
        raise ValueError(f"sampled answers need a temperature > 0, got {temperature}")
    return [t for n in range(passes) for t in answer_prompts(target, prompts, max_new_tokens, batch=batch,
                                                             progress=progress, temperature=temperature,
                                                             seed=(n + 1) * 1_000_003)]


def split_heldout(items: Sequence[T], heldout: int) -> tuple[list[T], list[T]]:
    """(train, held out): the newest `heldout` items (at most a fifth of them) are held out."""
    n_train = len(items) - min(heldout, len(items) // 5)
    return list(items[:n_train]), list(items[n_train:])


def answered_traces(target: LoadedModel, prompts: Sequence[list[int]], max_new_tokens: int, *, heldout: int,
                    sampled: int = 0, temperature: float = 0.0, progress: Callable[[int], None] | None = None
                    ) -> tuple[list[RequestTrace], list[RequestTrace]]:
    """(train, held out) from the target's greedy answers to `prompts` (the last `heldout`, at most
    a fifth, held out), plus `sampled` answers at `temperature` per training prompt;
    `progress(n)` after each chunk of len(prompts) + sampled * n_train requests."""
    train, held = split_heldout(answer_prompts(target, prompts, max_new_tokens, progress=progress), heldout)
    train += sampled_answers(target, prompts[: len(train)], max_new_tokens, sampled, temperature, progress=progress)
    return train, held


_MARKER = "\u2063LIVEDRAFT_USER_TURN\u2063"


# the system turn of a topic-seeded written prompt: of three wordings tried on SmolLM2-135M (16 prompts over four
# topics each), the one whose prompts most often kept to their topic
TOPIC_SYSTEM = "You are an expert in {topic}. Users ask you questions about {topic}."


def user_turn_prefix(tokenizer: object, system: str = "") -> list[int]:
    """The chat template's tokens up to where a user's message begins (its system turn, if the
    template adds one by default, included; `system`, when given, is the system turn instead):
    what `synthesize_prompts` continues from."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise LivedraftError("the target's tokenizer has no chat template: prompts cannot be synthesized from it")
    turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": _MARKER}]
    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    if _MARKER not in text:
        raise LivedraftError("the target's chat template does not echo the user's message: cannot find where a "
                             "user turn begins")
    return list(tokenizer(text[: text.index(_MARKER)], add_special_tokens=False).input_ids)


def synthesize_prompts(target: LoadedModel, n: int, *, max_prompt_tokens: int = 96, temperature: float = 1.0,
                       seed: int = 0, batch: int = 16, min_chars: int = 12, opener: str = "",
                       topics: Sequence[str] = (), progress: Callable[[int], None] | None = None) -> list[str]:
    """`n` distinct user prompts written by the instruct target itself (Magpie, Xu et al. 2024):
    the chat template up to the start of a user turn, sampled at `temperature` until the turn
    ends. A model's own user turns follow the distribution its instruction tuning saw, so a head
    warm-started on them is not tied to one prompt template. Kept: turns that ended (end of
    turn within `max_prompt_tokens`), at least `min_chars` long, each once; sampling goes on, in
    seeded rounds, until `n` are kept (a round samples what is missing, at least a batch; at most 8
    rounds, else a LivedraftError). An `opener`
    ("Write a Python function that") starts every turn: the target writes the rest, so prompts
    stay in one domain and still do not follow a template. `topics` (per-domain seeds, as Magpie's
    system prompts): the sampled turns take them in turn, each after a system turn that names its
    topic (`TOPIC_SYSTEM`), so the prompts spread over subjects a small model's unseeded turns
    rarely reach; the system turn is not part of the prompt kept. `progress(m)` as each chunk of four
    batches adds m kept prompts (a round of thousands is not silent until it ends)."""
    if n <= 0:
        return []
    tok = target.tokenizer
    if tok is None:
        raise LivedraftError(f"target {target.model_id} has no tokenizer: prompts cannot be synthesized")
    opened = list(tok(opener, add_special_tokens=False).input_ids) if opener else []
    prefixes = [user_turn_prefix(tok, TOPIC_SYSTEM.format(topic=t)) + opened for t in topics] \
        or [user_turn_prefix(tok) + opened]
    kept: dict[str, None] = {}
    turn = 0  # the next row's topic, across rounds
    for rnd in range(8):
        # at least a batch: the last few missing cost one batched pass either way, and a narrow opener repeats
        rows = max(n - len(kept), batch)
        starts = [prefixes[(turn + j) % len(prefixes)] for j in range(rows)]
        turn += rows
        for traces in answer_chunks(target, starts, max_prompt_tokens, batch=batch,
                                    temperature=temperature, seed=seed + rnd * 1_000_003):
            before = len(kept)
            for t in traces:
                written = tok.decode(t.output_ids, skip_special_tokens=True)
                text = (opener + written).strip()
                if (t.finish_reason == "stop" and len(written.strip()) >= min_chars and text not in kept
                        and len(kept) < n):
                    kept[text] = None
            if progress is not None and len(kept) > before:
                progress(len(kept) - before)
        if len(kept) >= n:
            return list(kept)
    raise LivedraftError(f"synthesized only {len(kept)} of {n} distinct prompts in 8 rounds: the target rarely "
                         f"ends a user turn within {max_prompt_tokens} tokens (raise max_prompt_tokens)")


@dataclass
class CurvePoint:
    step: int
    train_seconds: float
    heldout_mean_acceptance_length: float
    heldout_first_token_acceptance: float
    loss: float


@dataclass
class WarmStartResult:
    out_dir: Path
    train_traces: int
    heldout_traces: int
    feature_seconds: float
    train_seconds: float
    steps: int
    curve: list[CurvePoint] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["out_dir"] = str(self.out_dir)
        return d


def heldout_acceptance(head: EagleHead, target: LoadedModel, heldout: Sequence[RequestTrace],
                       passes: dict[str, TargetPass], k: int) -> tuple[float, float]:
    """(mean acceptance length, first-token acceptance) of `head` replayed on greedy `heldout` at k."""
    drafter = FeatureDrafter(head, target.model.get_input_embeddings().weight, target.vocab_size, "eval")
    rep = replay_traces(heldout, drafter, length=DraftLengthConfig(k=k), vocab_size=target.vocab_size,
                        features=lambda t: passes[t.request_id].features)
    s = rep.stats
    return s.mean_acceptance_length, (s.per_position_acceptance[0] if s.per_position_acceptance else 0.0)


def warm_start(
    target: LoadedModel,
    train: Sequence[RequestTrace],
    heldout: Sequence[RequestTrace],
    out_dir: str | Path,
    cfg: TrainerConfig,
    *,
    init_dir: str | Path | None = None,
    k: int = 4,
    eval_every: int = 100,
    version: str | None = None,
    on_progress: Callable[[str, dict], None] | None = None,
) -> WarmStartResult:
    """Trains a head for `target` on `train` (a new head whose draft vocabulary is the training
    outputs' most frequent tokens, or the one at `init_dir`), measuring held-out acceptance every
    `eval_every` steps; writes the head to `out_dir` with its curve (warm_start.json).
    `on_progress(event, data)` receives "features", "step" and "eval" events."""
    train, skipped = usable(train, target)
    heldout = [t for t in usable(heldout, target)[0] if t.greedy]
    if not train:
        raise NotEnoughData(f"no usable training traces ({skipped} skipped): give prompts or traffic for this target")
    if init_dir is not None:
        head = EagleHead.load(init_dir, dtype=target.model.dtype, device=target.model.device)
        check_head_matches_target(head.config, target.model.config, str(init_dir))
        admitted = refresh_vocab(head, train, target, cfg.vocab_refresh)
        if admitted:
            log.info("%d tokens of the training outputs admitted to %s's draft vocabulary", admitted, init_dir)
    else:
        vocab = choose_draft_vocab(target, min(cfg.draft_vocab, target.vocab_size), [t.output_ids for t in train])
        head = init_head(target, vocab, seed=cfg.seed)
    notify = on_progress or (lambda event, data: None)
    t0 = time.perf_counter()
    extractor = FeatureExtractor(target, head.config.aux_layers)
    passes: dict[str, TargetPass] = {}
    for i in range(0, len(train) + len(heldout), 64):
        chunk = (list(train) + list(heldout))[i : i + 64]
        passes.update(zip((t.request_id for t in chunk), extractor(chunk), strict=True))
        notify("features", {"done": len(passes), "total": len(train) + len(heldout)})
    feature_s = time.perf_counter() - t0
    examples = make_examples(train, [passes[t.request_id] for t in train], cfg)
    embed, lm = target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight
    result = WarmStartResult(Path(out_dir), len(train), len(heldout), feature_s, 0.0, 0)

    def evaluate(step: int, loss: float, seconds: float) -> None:
        if not heldout:
            return
        mal, first = heldout_acceptance(head, target, heldout, passes, k)
        head.train()
        point = CurvePoint(step, round(seconds, 1), round(mal, 4), round(first, 4), round(loss, 4))
        result.curve.append(point)
        notify("eval", asdict(point))

    evaluate(0, float("nan"), 0.0)
    train_t0 = time.perf_counter()
    eval_s = 0.0

    def on_step(step: int, loss: float) -> float:
        nonlocal eval_s
        notify("step", {"step": step + 1, "loss": loss})
        if not (eval_every and (step + 1) % eval_every == 0):
            return 0.0
        e0 = time.perf_counter()
        evaluate(step + 1, loss, e0 - train_t0 - eval_s)
        eval_s += time.perf_counter() - e0
        return time.perf_counter() - e0

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        stats = train_head(head, examples, embed, lm, cfg, on_step=on_step)
    result.train_seconds, result.steps = stats.seconds, stats.steps
    if not result.curve or result.curve[-1].step != stats.steps:
        evaluate(stats.steps, stats.losses[-1], result.train_seconds)
    meta = {"version": version or Path(out_dir).name, "warm_start": {**result.to_dict(), "trainer": asdict(cfg)}}
    save_head(head, Path(out_dir), meta)
    (Path(out_dir) / "warm_start.json").write_text(json.dumps(result.to_dict(), indent=2))
    return result
