"""The eagle half of bench/bench_adaptation.py: frozen vs online-adapted EAGLE-3 head, and the offline
reference, on the same traffic. Every replay runs the engine loop against the logged outputs with the
target's features from one teacher-forced pass per request (computed once for the whole stream)."""

from __future__ import annotations

import dataclasses
import logging
import math
import shutil
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from bench.traffic import Request, chat_ids, prompt_pool, segments, served_tail
from online.config import LINEAGES, TrainerConfig
from online.replay.engine import ReplayReport, replay_traces
from online.trainer.eagle import distill_eagle
from online.trainer.round import ReplayMetrics, ShiftAnswers, catch_up, decide, shifted, target_passes, trains_on
from online.trainer.warmstart import answer_prompts, sampled_answers, warm_start
from online.trainer.windows import held_for_life
from runtime.adaptive import DraftLengthConfig
from runtime.drafters.eagle import EagleConfig
from runtime.drafters.factory import load_feature_drafter
from runtime.stats import RequestStats
from runtime.trace import RequestTrace

log = logging.getLogger("bench_adaptation")
T, M, R = TypeVar("T"), TypeVar("M"), TypeVar("R")


def as_trace(i: int, r: Request) -> RequestTrace:
    return RequestTrace(request_id=f"req-{i}", prompt_ids=r.prompt_ids, output_ids=r.output_ids, steps=[],
                        target_model="target", drafter_version="-", max_new_tokens=r.max_new_tokens,
                        finish_reason=r.finish_reason, tag=r.tag)


def initial_head(args, target, cache: Path) -> Path:
    """An EAGLE-3 head warm-started on general explanations (none of the benchmark's domains), cached."""
    out = cache / f"eagle-topics-{args.init_requests}r-{args.init_minutes:g}min"
    if (out / "config.json").is_file():
        return out
    prompts = [chat_ids(target, p) for p in prompt_pool("topics", args.init_requests + 16, seed=7)]
    traces = answer_prompts(target, prompts, args.max_new_tokens)
    cfg = TrainerConfig(steps=1_000_000, max_seconds=args.init_minutes * 60, batch_size=8, lr=1e-3, ce_weight=0.2,
                        warmup_steps=20)
    res = warm_start(target, traces[:-16], traces[-16:], out, cfg, eval_every=0, version="initial")
    log.info("initial head: %d topics requests, %.0fs of training, held-out MAL %.3f", res.train_traces,
             res.train_seconds, res.curve[-1].heldout_mean_acceptance_length if res.curve else float("nan"))
    return out


def replay_head(path: Path, version: str, target, traces: list[RequestTrace], passes: dict, k: int
                ) -> ReplayReport:
    """The eagle head at `path` replayed through the engine loop at fixed `k` over `traces` (kept in the
    report), with the target's features from `passes` (request id -> TargetPass)."""
    return replay_traces(traces, load_feature_drafter(path, target, version=version), length=DraftLengthConfig(k=k),
                         vocab_size=target.vocab_size, features=lambda t: passes[t.request_id].features,
                         keep_traces=True)


def per_request(traces: list[RequestTrace]) -> list[RequestStats]:
    out = []
    for t in traces:
        st = RequestStats(prompt_tokens=len(t.prompt_ids), output_tokens=len(t.output_ids))
        for s in t.steps:
            st.record_step(len(s.drafted), s.accepted)
        out.append(st)
    return out


def paired_se(a: list[RequestTrace], b: list[RequestTrace]) -> float:
    """Standard error of the mean per-request difference in mean acceptance length between two
    replays of the same requests (in order): the gate's noise on a held-out slice of that size."""
    d = [x.mean_acceptance_length - y.mean_acceptance_length
         for x, y in zip(per_request(a), per_request(b), strict=True)]
    return statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")


def cross_fit(items: list[T], fit: Callable[[list[T], int], M], score: Callable[[M, list[T]], list[R]],
              folds: int = 2) -> list[R]:
    """Scores every item with a model fitted only on the other folds (item i is in fold i % folds):
    `fit(train_items, fold)` -> model, `score(model, items)` -> one result per item, in order."""
    out: list[R | None] = [None] * len(items)
    for fold in range(folds):
        held = [i for i in range(len(items)) if i % folds == fold]
        model = fit([x for i, x in enumerate(items) if i % folds != fold], fold)
        for i, r in zip(held, score(model, [items[i] for i in held]), strict=True):
            out[i] = r
    return out  # type: ignore[return-value]


def held_out(n: int, n_hold: int, mode: str = "newest", ids: Sequence[str] | None = None) -> set[int]:
    """Indices of a window of `n` traces (oldest first) held out for the gate: the newest `n_hold`
    (daemon.holdout "newest"); `n_hold` spread evenly over the window, the newest included; or
    ("stable", the daemon's default) the requests whose id in `ids` the daemon's own rule holds out
    for life, one in m = n / n_hold (rounded) by a hash of the id (online.trainer.windows.held_for_life),
    so a window holds about `n_hold` of them. The last two let a round train on the newest traffic;
    only "stable" also keeps a gate from scoring a trace an earlier round of a trainee lineage trained
    on ("spread" moves with the window). A/Bs: docs/benchmarks.md."""
    if not 1 <= n_hold < n:
        raise ValueError(f"need 1 <= n_hold < n, got n_hold={n_hold} n={n}")
    if mode == "newest":
        return set(range(n - n_hold, n))
    if mode == "spread":
        return {n - 1 - (i * n) // n_hold for i in range(n_hold)}
    if mode == "stable":
        if ids is None or len(ids) != n:
            raise ValueError(f"the stable holdout needs the window's {n} request ids")
        m = max(2, round(n / n_hold))
        held = {i for i, r in enumerate(ids) if held_for_life(r, m)}
        if not 1 <= len(held) < n:
            raise ValueError(f"a window of {n} requests holds {len(held)} for the gate: a longer window, please")
        return held
    raise ValueError(f"unknown holdout mode {mode!r}: newest, spread or stable")


def after_gate(champion: Path, parent: Path, candidate: Path, promoted: bool, lineage: str, keep: Path,
               trains_on: bool = True) -> tuple[Path, Path, set[Path]]:
    """(champion, the next round's parent, directories no longer needed) after a round's gate, as
    the daemon's `trainer.lineage`: "champion", a round trains from the champion; "trainee", from the
    previous round's candidate, promoted or not, while `trains_on` (online.trainer.round.trains_on:
    it did not fall behind the champion by more than the margin); the gate still decides what
    serves. `keep` (the initial head) is never among the unneeded."""
    if lineage not in LINEAGES:
        raise ValueError(f"unknown lineage {lineage!r}: one of {LINEAGES}")
    new_champion = candidate if promoted else champion
    new_parent = candidate if lineage == "trainee" and trains_on else new_champion
    return new_champion, new_parent, {champion, parent, candidate} - {keep, new_champion, new_parent}


@dataclass
class EagleRun:
    """The online half of the eagle bench: per-request stats of the frozen and the adapted head, the
    rounds, and what the offline references need (the initial head, the target's passes, the stream)."""

    frozen: list[RequestStats]
    adapted: list[RequestStats]
    rounds: list[dict]
    train_seconds: float
    total_steps: int
    init_dir: Path
    logged: list[RequestTrace]
    passes: dict
    timed_versions: dict[str, Path] = field(default_factory=dict)  # domain -> the version to time (served_tail)


def round_window(served: list[RequestTrace], since: int, window: int, window_max: int,
                 hold_out: Callable[[list[RequestTrace]], set[int]], cfg: TrainerConfig,
                 ) -> tuple[list[RequestTrace], list[RequestTrace], int]:
    """What a round reads: (`base_train`, the round's window, the new `since`). `base` is the newest
    `window` served traces and `base_train` those of them `hold_out` leaves: what the shift, catch-up
    and shift-answer rules read, whatever the round trains on. With `window_max` (0: off, the window
    is `base`) the window is every trace from `since`, the first one after the last shift, at least
    `base` and at most the newest `window_max`: a steady stream trains on more of itself, and after a
    shift the traces of before drop out as soon as there are `window` after it. A shift
    (online.trainer.round.shifted) moves `since` to the first of the newest quarter of `base_train`
    that showed it, unless the last shift is still within `base` (the same shift, seen again while
    the older traces it is measured against are still there)."""
    first = len(served) - min(window, len(served))
    base = served[first:]
    held = hold_out(base)
    train_at = [first + i for i in range(len(base)) if i not in held]
    base_train = [served[i] for i in train_at]
    if not window_max:
        return base_train, base, since
    if since < first and shifted(base_train, cfg):
        since = train_at[-max(1, len(train_at) // 4)]  # shifted's newest quarter
    start = min(max(since, len(served) - window_max), first)
    return base_train, served[start:], since


def run_eagle(args, target, traffic: list[Request], out: Path, work: Path) -> EagleRun:
    """Frozen and online-adapted head over the stream. With `args.serve_prompts` (n), the version serving
    each segment's n-th last request is copied to `<out>_served/<domain>`, to be timed on the segment's
    last n requests (bench.traffic.served_tail: prompts it never trained on)."""
    init_dir = Path(args.drafter) if args.drafter else initial_head(args, target, out.parent)
    logged = [as_trace(i, r) for i, r in enumerate(traffic)]
    t0 = time.perf_counter()
    aux_layers = EagleConfig.read(init_dir).aux_layers
    passes = target_passes(target, aux_layers, logged)
    log.info("target features for %d requests in %.0fs", len(logged), time.perf_counter() - t0)

    def replay(path: Path, traces: list[RequestTrace], version: str) -> ReplayReport:
        return replay_head(path, version, target, traces, passes, args.k)

    frozen = per_request(replay(init_dir, logged, "initial").traces)
    cfg = TrainerConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, ce_weight=0.2,
                        promote_margin=args.margin, replay_k=args.k, seed=args.seed, warmup_steps=2,
                        vocab_refresh=args.vocab_refresh, carry_optimizer=args.carry_optimizer,
                        catch_up_steps=args.catch_up_steps, catch_up_ratio=args.catch_up_ratio,
                        catch_up_answers=args.catch_up_answers, shift_answers=args.shift_answers,
                        shift_prompts=args.shift_prompts, shift_temperature=args.shift_temperature)
    answers = ShiftAnswers()  # what the daemon's trainer keeps across rounds
    champion_dir, version = init_dir, "initial"
    parent_dir = init_dir  # what a round trains from: the champion, or (--lineage trainee) the last candidate
    promoted = False  # the last round's verdict (a catch-up round follows a promotion)
    served: list[RequestTrace] = []
    run = EagleRun(frozen, [], [], 0.0, 0, init_dir, logged, passes)
    # the first request a segment's served version is timed on -> its domain
    tails = served_tail(segments(traffic, args.domains.split(",")), args.serve_prompts) if args.serve_prompts else {}
    timed_from = {s: d for d, (s, _) in tails.items()}
    since = 0  # --window-max: index in `served` of the first trace after the last shift a round saw

    def hold_out(window: list[RequestTrace]) -> set[int]:
        return held_out(len(window), max(1, round(len(window) * args.holdout)), args.holdout_mode,
                        [t.request_id for t in window])

    for r0 in range(0, len(logged), args.every):
        block = replay(champion_dir, logged[r0 : r0 + args.every], version).traces
        served += block
        run.adapted += per_request(block)
        for domain in (timed_from[i] for i in range(r0, r0 + len(block)) if i in timed_from):
            run.timed_versions[domain] = out.parent / f"{out.name}_served" / domain
            shutil.rmtree(run.timed_versions[domain], ignore_errors=True)
            shutil.copytree(champion_dir, run.timed_versions[domain])
        if r0 + args.every >= len(logged):
            break
        base_train, window, since = round_window(served, since, args.window, args.window_max, hold_out, cfg)
        held = hold_out(window)
        train = [t for i, t in enumerate(window) if i not in held]
        hold = [logged[int(t.request_id[4:])] for i, t in enumerate(window) if i in held]
        t0 = time.perf_counter()
        cand_version = f"round{len(run.rounds) + 1}"
        extra = answers.for_round(base_train, cfg, target)
        why = catch_up(base_train, promoted, cfg, len(extra))
        round_cfg = dataclasses.replace(cfg, steps=cfg.catch_up_steps) if why else cfg
        trained = train + extra
        passes.update(target_passes(target, aux_layers, [t for t in trained if t.request_id not in passes]))
        res = distill_eagle(parent_dir, trained, work / cand_version, round_cfg, target, passes=passes,
                            version=cand_version)
        run.total_steps += res.steps
        c_report, h_report = replay(work / cand_version, hold, cand_version), replay(champion_dir, hold, version)
        c, h = ReplayMetrics.from_report(c_report), ReplayMetrics.from_report(h_report)
        promoted, reason = decide(c, h, cfg.promote_margin)
        seconds = time.perf_counter() - t0
        run.train_seconds += seconds
        run.rounds.append({"after_request": r0 + len(block), "candidate": cand_version, "promoted": promoted,
                           "candidate_mal": round(c.mean_acceptance_length, 3),
                           "champion_mal": round(h.mean_acceptance_length, 3), "train_traces": len(train),
                           "window": len(window),
                           "gain_se": round(paired_se(c_report.traces, h_report.traces), 4),
                           "holdout": len(hold), "steps": res.steps, "catch_up": why,
                           "answers": len(trained) - len(train),
                           "seconds": round(seconds, 1)})
        log.info("round %d after %d requests: %s (%.0fs)", len(run.rounds), r0 + len(block), reason, seconds)
        if promoted:
            version = cand_version
        champion_dir, parent_dir, unused = after_gate(champion_dir, parent_dir, work / cand_version, promoted,
                                                      args.lineage, keep=init_dir,
                                                      trains_on=trains_on(c, h, cfg.promote_margin))
        for d in unused:
            shutil.rmtree(d, ignore_errors=True)
    return run


def _reference_cfg(run: EagleRun, args) -> TrainerConfig:
    """An offline reference's training: the initial head distilled for as many steps as all rounds together."""
    return TrainerConfig(steps=max(run.total_steps, 1), batch_size=args.batch_size, lr=args.lr, ce_weight=0.2,
                         seed=args.seed, warmup_steps=2, vocab_refresh=args.vocab_refresh)


def references(run: EagleRun, args, target, work: Path) -> dict:
    """The offline references, the initial head distilled for as many steps as all rounds together:
    cross-fitted (`offline_unseen`: trained on one half of the stream, every other request of every
    domain, and scored on the other half, and the other way round -- it knows the traffic in advance,
    but not the request) and, with `args.references == "both"`, on the whole stream and scored on it
    (`offline`: it has trained on every request it is scored on)."""
    cfg = _reference_cfg(run, args)

    def fit(train: list[RequestTrace], name: str) -> Path:
        t0 = time.perf_counter()
        distill_eagle(run.init_dir, train, work / name, cfg, target, passes=run.passes, version=name)
        log.info("offline reference %s: %d steps on %d requests in %.0fs", name, cfg.steps, len(train),
                 time.perf_counter() - t0)
        return work / name

    def score(path: Path, traces: list[RequestTrace]) -> list[RequestStats]:
        return per_request(replay_head(path, path.name, target, traces, run.passes, args.k).traces)

    out = {"offline_steps": cfg.steps,
           "offline_unseen": cross_fit(run.logged, lambda train, fold: fit(train, f"fold{fold}"), score)}
    if args.references == "both":
        out["offline"] = score(fit(run.logged, "offline"), run.logged)
    return out


def past_windows(bounds: dict[str, tuple[int, int]], after: Sequence[int], n: int) -> list[tuple[str, int, int, int]]:
    """(domain, n_after, cut, end) for every segment after the first and every `n_after` in `after` that
    leaves requests to score: a past reference trains on the stream before `cut` (= the segment's start +
    n_after) and is scored on [cut, end), the next `n` requests of the segment at most."""
    out = []
    for j, (d, (a, b)) in enumerate(bounds.items()):
        for k in after:
            if j > 0 and a + k < b:
                out.append((d, k, a + k, min(a + k + n, b)))
    return out


PAST_DATA = ("all", "segment", "sampled")
PAST_SAMPLED, PAST_TEMPERATURE = 2, 0.8  # the warm start's recipe: two sampled answers per prompt at 0.8


def past_training(data: str, logged: list[RequestTrace], start: int, cut: int, target, max_new_tokens: int
                  ) -> list[RequestTrace]:
    """What a past reference trains on, the segment starting at `start` served up to `cut`: every request
    before the cut (`all`), the new segment's only (`segment`), or every request plus the target's
    answers sampled again to the new segment's prompts (`sampled`: PAST_SAMPLED per prompt at
    PAST_TEMPERATURE, data a daemon could make at a shift without a request more)."""
    if data == "all":
        return logged[:cut]
    if data == "segment":
        return logged[start:cut]
    if data == "sampled":
        prompts = [t.prompt_ids for t in logged[start:cut]]
        return logged[:cut] + sampled_answers(target, prompts, max_new_tokens, PAST_SAMPLED, PAST_TEMPERATURE)
    raise ValueError(f"unknown past data {data!r}: one of {', '.join(PAST_DATA)}")


def past_references(run: EagleRun, args, target, work: Path, bounds: dict[str, tuple[int, int]], n: int
                    ) -> list[dict]:
    """What any learner of this head could serve N requests after a shift, with the loop's data but
    no deadline: the initial head distilled with the cross-fitted reference's budget on what
    `past_training` gives for each of `args.past_data` (`all`: every request served before the cut),
    scored on the next `n` requests beside the online head that served them (its per-request stats are
    returned; the report sets both against the cross-fitted reference on the same requests)."""
    cfg = _reference_cfg(run, args)
    out = []
    for domain, n_after, cut, end in past_windows(bounds, args.past_references, n):
        for data in args.past_data:
            name = f"past-{domain}-{n_after}-{data}"
            t0 = time.perf_counter()
            train = past_training(data, run.logged, cut - n_after, cut, target, args.max_new_tokens)
            distill_eagle(run.init_dir, train, work / name, cfg, target, passes=run.passes, version=name)
            stats = per_request(replay_head(work / name, name, target, run.logged[cut:end], run.passes,
                                            args.k).traces)
            log.info("past reference %s: %d steps on %d requests, scored on %d-%d in %.0fs", name, cfg.steps,
                     len(train), cut + 1, end, time.perf_counter() - t0)
            shutil.rmtree(work / name, ignore_errors=True)
            out.append({"domain": domain, "after": n_after, "data": data, "cut": cut, "end": end, "stats": stats})
    return out
