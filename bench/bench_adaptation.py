"""Adaptation benchmark: a frozen drafter vs one distilled online from the traffic it serves.

Traffic is one domain, then a shift, then another (default stories -> Python
code -> instructions; built-in prompt pools, chat template, greedy, 64 new
tokens). Two drafters serve the same request stream at fixed k:

(a) frozen: the initial drafter, never updated. `--kind eagle` (the default): an
    EAGLE-3 head warm-started offline on general explanations (the "topics" pool,
    none of the three domains; `--init-minutes` of training, cached), i.e. a
    drafter trained offline on other traffic than the service sees. `--kind model`:
    a drafter derived from the target's first layers, untrained;
(b) adapted: starts as the same drafter; after every W requests a training
    round distils a candidate from the current champion on a window of the
    traffic served so far (online/trainer/distill.py, the project's trainer:
    soft labels at rejected positions + cross-entropy on the target's tokens),
    scores candidate and champion on the newest, held-out part of the window,
    and swaps the candidate in for the next requests only if it wins
    (online.trainer.round.decide, the production gate);
(c) eagle only, two references, each the initial head distilled offline for as
    many steps as all online rounds took together: on the whole traffic stream and
    scored on it (it has trained on every request it is scored on: memorisation
    included), and cross-fitted -- trained on every other request of the stream and
    scored on the requests it did not train on, both halves -- what knowing the
    traffic in advance buys without having seen the request; online adaptation
    should come close to the latter;
(d) eagle, with `--past-references N,...`: per segment after the first, the
    initial head distilled with the references' budget on every request served
    before the segment's N-th, scored on the next requests -- what any learner of
    this head could serve N requests after a shift with the data the loop had by
    then and no deadline: a bound on recovery that no round cadence beats;
    `--past-data` trains it on the new segment's requests only, or adds the
    target's sampled answers to their prompts (data a daemon could make at a
    shift), to see whether that bound is the data's or the mix's.

To fit a CPU budget the target runs once: it answers every prompt greedily
(batched) and logs its top-k logprobs per position. Serving each request with
a drafter is then scored by teacher-forced replay — one drafter forward per
request, exact for greedy (bench/traffic.py; equal to the engine-loop replay
step for step, tests/test_bench_traffic.py) — and the trace that serving would
have logged (steps, soft labels at rejections) is what the trainer learns from.
An eagle head replays through the engine loop (online.replay) with the target's
features from one teacher-forced pass per request, as the production trainer does.

    nice -n 10 python -m bench.bench_adaptation            # table + bench/results/adaptation-eagle.{json,png}
    nice -n 10 python -m bench.bench_adaptation --kind model   # bench/results/adaptation.{json,png}
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.traffic import (
    OPENERS,
    THREADS_HELP,
    Request,
    cached_requests,
    chat_ids,
    drafter_predictions,
    greedy_traffic,
    prompt_pool,
    request_stats,
    segments,
    served_tail,
    served_trace,
    simulate_steps,
    start_run,
    teacher_forced_replay,
    written_pool,
)
from online.config import LINEAGES, TrainerConfig
from online.trainer.common import TrainingError, check_config
from online.trainer.distill import distill
from online.trainer.round import ReplayMetrics, decide
from runtime.adaptive import DraftLengthConfig
from runtime.derive import derive_drafter
from runtime.drafters.factory import load_model_drafter
from runtime.loader import load_model
from runtime.stats import RequestStats

log = logging.getLogger("bench_adaptation")


def summary(stats: list[RequestStats]) -> dict:
    s = RequestStats.total(stats)
    pos = s.per_position_acceptance
    return {"mean_acceptance_length": round(s.mean_acceptance_length, 3),
            "acceptance_rate": round(s.acceptance_rate, 3),
            "first_token_acceptance": round(pos[0], 3) if pos else 0.0, "requests": s.requests}


def rolling(xs: list[float], w: int) -> list[float]:
    return [statistics.fmean(xs[max(0, i - w + 1) : i + 1]) for i in range(len(xs))]


def rate(stats: list[RequestStats]) -> float:
    """Acceptance rate pooled over requests: accepted / drafted tokens (0 when nothing was drafted)."""
    return RequestStats.total(stats).acceptance_rate if stats else 0.0


AFTER_SHIFT = (50, 100)  # the report's acceptance rate over a segment's first requests
PAST_SCORED = 32  # requests after a past reference's cut that it is scored on (--past-references)


def last_third(a: int, b: int) -> slice:
    """A segment's last third, [a, b) being the segment's requests."""
    return slice(b - (b - a) // 3, b)


def after_shift(adapted: list[RequestStats], start: int, end: int, n: int) -> float:
    """The adapted drafter's acceptance rate pooled over the first `n` requests of the segment
    [start, end): how fast it learned after the shift. Unlike `recovery`, no threshold to cross, so it
    compares two settings on the same traffic with less noise."""
    return rate(adapted[start : min(start + n, end)])


def recovered_at(adapted: list[RequestStats], start: int, end: int, w: int,
                 bar: Callable[[slice], float]) -> int | None:
    """Requests after a shift (the segment is [start, end)) until the adapted drafter's acceptance rate,
    pooled over its last `w` requests, first reaches 90 % of `bar(those requests)` (None: never)."""
    return next((i for i in range(w, end - start + 1)
                 if rate(adapted[start + i - w : start + i]) >= 0.9 * bar(slice(start + i - w, start + i))),
                None)


def recovery(adapted: list[RequestStats], start: int, end: int, w: int) -> int | None:
    """Requests after a shift until the adapted drafter's pooled rate over its last `w` requests first
    reaches 90 % of its level over the segment's last third (None: never)."""
    level = rate(adapted[last_third(start, end)])
    return recovered_at(adapted, start, end, w, lambda _: level)


def recovery_to_reference(adapted: list[RequestStats], reference: list[RequestStats], start: int, end: int,
                          w: int) -> int | None:
    """Requests after a shift until the adapted drafter's acceptance rate over its last `w` requests first
    reaches 90 % of the cross-fitted reference's over the same requests (None: never). Unlike `recovery`,
    whose threshold is the adapted drafter's own level late in the segment, the bar moves with the
    requests: easier requests late in a segment raise both sides alike, so this counts how long the
    loop lags a head that knew the domain, not how the segment's traffic is ordered."""
    return recovered_at(adapted, start, end, w, lambda window: rate(reference[window]))


def load_traffic(target, args, cache: Path) -> list[Request]:
    """The stream: per domain, the target's greedy answers to its prompts, cached per domain (a
    long run that fails in one domain keeps the others)."""
    traffic: list[Request] = []
    for domain in args.domains.split(","):
        key = {"target": target.model_id, "domain": domain, "per_domain": args.per_domain,
               "max_new_tokens": args.max_new_tokens, "seed": args.seed, "topk": 8, "pool": args.pool}
        if args.pool == "written":  # what the target was asked to write
            key["openers"] = list(OPENERS[domain])

        def answer(domain: str = domain) -> list[Request]:
            n, seed = args.per_domain, args.seed
            prompts = written_pool(target, domain, n, seed) if args.pool == "written" else prompt_pool(domain, n, seed)
            out = greedy_traffic(target, [chat_ids(target, p) for p in prompts], args.max_new_tokens, tag=domain)
            log.info("target answered %d %s prompts", len(out), domain)
            return out

        traffic += cached_requests(cache.with_name(f"{cache.stem}-{domain}{cache.suffix}"), key, answer)
    return traffic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", help="initial drafter dir (default: derive one with --layers)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--domains", default="stories,code,instructions")
    ap.add_argument("--per-domain", type=int, default=40)
    ap.add_argument("--pool", choices=("templates", "written"), default="templates",
                    help="the prompts: the built-in templates (stories 400, code 240, instructions 180 distinct), "
                         "or written by the target itself per domain, as many as --per-domain asks "
                         "(bench.traffic.written_pool)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--every", type=int, default=8, help="W: requests between training rounds")
    ap.add_argument("--window", type=int, default=32, help="newest served traces a round sees")
    ap.add_argument("--window-max", type=int, default=0,
                    help="eagle: a round's window grows past --window, up to this many of the newest traces, while "
                         "no shift is seen in its newest --window (online.trainer.round.shifted); a shift cuts it "
                         "back to --window (0: a fixed window of --window)")
    ap.add_argument("--holdout", type=float, default=0.25, help="newest share of the window held out for the gate")
    ap.add_argument("--holdout-mode", choices=("newest", "spread", "stable"), default="newest",
                    help="eagle: hold out the newest share of the window, the same share spread evenly over it, "
                         "or (stable) one request in m = 1 / --holdout for life, by the daemon's hash of its id")
    ap.add_argument("--steps", type=int, help="optimizer steps per round (default: model 14, eagle 16)")
    ap.add_argument("--batch-size", type=int, help="traces per step (default: model 4, eagle 8)")
    ap.add_argument("--lr", type=float, help="learning rate (default: model 1e-3, eagle 5e-4)")
    ap.add_argument("--vocab-refresh", type=int, default=TrainerConfig.vocab_refresh,
                    help="eagle: a round admits output tokens seen this often in its window into the draft "
                         "vocabulary (0: the vocabulary stays fixed)")
    ap.add_argument("--lineage", choices=LINEAGES, default=TrainerConfig.lineage,
                    help="eagle: a round trains from the champion, or from the previous round's candidate "
                         "whether or not the gate promoted it, unless it fell behind the champion by more "
                         "than --margin (the daemon's trainer.lineage; the gate still decides what serves)")
    ap.add_argument("--carry-optimizer", action=argparse.BooleanOptionalAction, default=TrainerConfig.carry_optimizer,
                    help="eagle, --lineage trainee: a round resumes its parent's AdamW state and learning rate "
                         "(warm-up once, then constant: the daemon's trainer.carry_optimizer, on by default); "
                         "--no-carry-optimizer: a fresh optimizer with its own warm-up and decay each round")
    ap.add_argument("--margin", type=float, default=0.05, help="promotion margin on mean acceptance length")
    ap.add_argument("--catch-up-steps", type=int, default=TrainerConfig.catch_up_steps,
                    help="eagle: steps of a catch-up round (the daemon's trainer.catch_up_steps; 0: none)")
    ap.add_argument("--catch-up-ratio", type=float, default=TrainerConfig.catch_up_ratio,
                    help="eagle: the served acceptance ratio, newest quarter of the window to the rest, "
                         "below which a round catches up (trainer.catch_up_ratio)")
    ap.add_argument("--catch-up-answers", action=argparse.BooleanOptionalAction,
                    default=TrainerConfig.catch_up_answers,
                    help="eagle: every round that trains on answers sampled after a shift (--shift-answers) is a "
                         "catch-up round too (the daemon's trainer.catch_up_answers; off: only a round after a "
                         "promotion or on a detected shift)")
    ap.add_argument("--shift-answers", type=int, default=TrainerConfig.shift_answers,
                    help="eagle: from a shift on, the target answers the next --shift-prompts prompts this many more "
                         "times and rounds train on those answers too (the daemon's trainer.shift_answers; 0: none)")
    ap.add_argument("--shift-prompts", type=int, default=TrainerConfig.shift_prompts,
                    help="eagle: how many prompts after a shift are answered again (trainer.shift_prompts)")
    ap.add_argument("--shift-temperature", type=float, default=TrainerConfig.shift_temperature,
                    help="eagle: the temperature of those answers (trainer.shift_temperature)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help=THREADS_HELP)
    ap.add_argument("--kind", choices=("eagle", "model"), default="eagle")
    ap.add_argument("--references", choices=("crossfit", "both", "none"), default="crossfit",
                    help="eagle: after the online run, distil the cross-fitted offline reference (c) (two "
                         "distillations, each as many steps as all rounds together: longer than the online run), "
                         "both references (three), or none")
    ap.add_argument("--past-references", type=lambda v: [int(x) for x in v.split(",") if x], default=[],
                    metavar="N[,N...]",
                    help="eagle: after the references, per later segment and N, distil the initial head with the "
                         "reference's budget on every request before the segment's N-th and score it on the next "
                         f"{PAST_SCORED}: what any learner with the loop's data could serve N requests after a shift "
                         "(one distillation each)")
    ap.add_argument("--past-data", type=lambda v: [x for x in v.split(",") if x], default=["all"],
                    metavar="DATA[,DATA...]",
                    help="eagle: what each past reference trains on, one reference per cut and choice: all (every "
                         "request before the cut), segment (the new segment's only), sampled (all, and the target's "
                         "answers sampled twice more at temperature 0.8 to the new segment's prompts)")
    ap.add_argument("--serve-prompts", type=int, default=0,
                    help="eagle: time, against the target alone on our engine, the version that served each "
                         "segment's N-th last request, on the segment's last N requests: prompts neither it nor a "
                         "round before it trained on (0: skip)")
    ap.add_argument("--serve-reps", type=int, default=3, help="repetitions of --serve-prompts")
    ap.add_argument("--init-minutes", type=float, default=5.0, help="eagle: offline warm start of the initial head")
    ap.add_argument("--init-requests", type=int, default=200, help="eagle: topics prompts of that warm start")
    ap.add_argument("--out", help="result prefix (default: bench/results/adaptation-eagle, or bench/results/adaptation "
                                  "for --kind model)")
    args = ap.parse_args()
    from bench.adaptation_eagle import PAST_DATA

    if args.window_max and (args.kind != "eagle" or args.window_max <= args.window):
        ap.error(f"--window-max needs --kind eagle and a value over --window ({args.window}), "
                 f"got {args.window_max} for --kind {args.kind}")

    if args.catch_up_answers and not (args.kind == "eagle" and args.shift_answers and args.catch_up_steps):
        ap.error("--catch-up-answers needs --kind eagle, --shift-answers and --catch-up-steps")
    if bad := [x for x in args.past_data if x not in PAST_DATA]:
        ap.error(f"--past-data: unknown {', '.join(bad)} (choose from {', '.join(PAST_DATA)})")
    try:  # the daemon's own check of these keys, at parse time
        check_config(TrainerConfig(shift_answers=args.shift_answers, shift_prompts=args.shift_prompts,
                                   shift_temperature=args.shift_temperature))
    except TrainingError as e:
        ap.error(f"--shift-answers, --shift-prompts, --shift-temperature: {e}")
    args.out = args.out or ("bench/results/adaptation-eagle" if args.kind == "eagle" else "bench/results/adaptation")
    for key, model, eagle in (("steps", 14, 16), ("batch_size", 4, 8), ("lr", 1e-3, 5e-4)):
        if getattr(args, key) is None:
            setattr(args, key, eagle if args.kind == "eagle" else model)
    out, work = start_run(args)
    t_start = time.perf_counter()

    target = load_model(args.target)
    traffic = load_traffic(target, args, out.parent / f"{out.name}_traffic.json")
    t_traffic = time.perf_counter() - t_start
    if args.kind == "eagle":
        from bench.adaptation_eagle import past_references, references, run_eagle

        run = run_eagle(args, target, traffic, out, work)
        extra: dict = {"init": str(run.init_dir)}

        def write() -> None:  # after each phase: what was measured survives a later one's failure
            report(args, traffic, run.frozen, run.adapted, run.rounds, out,
                   {"traffic_s": round(t_traffic, 1), "training_rounds_s": round(run.train_seconds, 1),
                    "total_s": round(time.perf_counter() - t_start, 1), "torch_threads": torch.get_num_threads()},
                   extra)

        write()
        if args.serve_prompts:
            extra["served"] = served_speed(args, target, traffic, run.timed_versions)
            write()
        if args.references != "none":
            extra.update(references(run, args, target, work))
            write()
        if args.past_references:
            extra["past"] = past_references(run, args, target, work, segments(traffic, args.domains.split(",")),
                                            PAST_SCORED)
            write()
        shutil.rmtree(work, ignore_errors=True)
        return
    init_dir = Path(args.drafter) if args.drafter else derive_drafter(target, args.layers, work / "initial")

    frozen = load_model_drafter(init_dir, target)
    frozen_stats = teacher_forced_replay(frozen, traffic, args.k)
    cfg = TrainerConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, ce_weight=0.5, loss="fkl",
                        promote_margin=args.margin, replay_k=args.k, seed=args.seed)
    champion_dir, champion, version = init_dir, frozen, "initial"
    served: list[tuple[Request, object]] = []  # (request, the trace serving it logged)
    adapted_stats: list[RequestStats] = []
    rounds, t_train = [], 0.0
    for r0 in range(0, len(traffic), args.every):
        block = traffic[r0 : r0 + args.every]
        for i, (req, pred) in enumerate(zip(block, drafter_predictions(champion, block), strict=True)):
            adapted_stats.append(request_stats(req, simulate_steps(req, pred, args.k)))
            served.append((req, served_trace(req, pred, args.k, f"req-{r0 + i}", version, target.model_id)))
        if r0 + args.every >= len(traffic):
            break
        window = served[-args.window :]
        n_hold = max(1, round(len(window) * args.holdout))
        train, hold = [t for _, t in window[:-n_hold]], [r for r, _ in window[-n_hold:]]
        t0 = time.perf_counter()
        cand_version = f"round{len(rounds) + 1}"
        res = distill(champion_dir, train, work / cand_version, cfg, version=cand_version)
        cand = load_model_drafter(work / cand_version, target)
        c = ReplayMetrics.from_stats(cand_version, RequestStats.total(teacher_forced_replay(cand, hold, args.k)))
        h = ReplayMetrics.from_stats(version, RequestStats.total(teacher_forced_replay(champion, hold, args.k)))
        promoted, reason = decide(c, h, cfg.promote_margin)
        seconds = time.perf_counter() - t0
        t_train += seconds
        rounds.append({"after_request": r0 + len(block), "candidate": cand_version, "promoted": promoted,
                       "candidate_mal": round(c.mean_acceptance_length, 3),
                       "champion_mal": round(h.mean_acceptance_length, 3), "train_traces": len(train),
                       "holdout": len(hold), "steps": res.steps, "seconds": round(seconds, 1)})
        log.info("round %d after %d requests: %s (%.0fs)", len(rounds), r0 + len(block), reason, seconds)
        if promoted:
            if champion_dir != init_dir:
                shutil.rmtree(champion_dir, ignore_errors=True)
            champion_dir, champion, version = work / cand_version, cand, cand_version
        else:
            shutil.rmtree(work / cand_version, ignore_errors=True)
    report(args, traffic, frozen_stats, adapted_stats, rounds, out,
           {"traffic_s": round(t_traffic, 1), "training_rounds_s": round(t_train, 1),
            "total_s": round(time.perf_counter() - t_start, 1), "torch_threads": torch.get_num_threads()})
    shutil.rmtree(work, ignore_errors=True)


def served_speed(args, target, traffic: list[Request], versions: dict[str, Path]) -> list[dict]:
    """Tokens/s of a served version against the target alone, on our engine, side by side per prompt
    (bench.bench_do_no_harm.run_case: the adaptive rule at k <= 8, `--serve-reps` repetitions, alternating
    order): per segment, the version that served its `--serve-prompts`-th last request, on the segment's
    last `--serve-prompts` requests (served_tail), none of which it or a round before it trained on."""
    from bench.bench_do_no_harm import row, run_case, warm
    from runtime.drafters.factory import load_feature_drafter
    from runtime.drafters.none import NoDrafter
    from runtime.engine import SpeculativeEngine

    base = SpeculativeEngine.for_model(target, NoDrafter())
    warm(base, traffic[0].prompt_ids)
    opts = argparse.Namespace(k_max=8, probe_every=DraftLengthConfig.probe_every, max_new_tokens=args.max_new_tokens,
                              reps=args.serve_reps, cold=False)
    results = []
    for domain, (a, b) in served_tail(segments(traffic, args.domains.split(",")), args.serve_prompts).items():
        if domain not in versions:
            continue
        prompts = [r.prompt_ids for r in traffic[a:b]]
        r = run_case(f"{domain}: the version serving request {a + 1}, on requests {a + 1}-{b}",
                     lambda p=versions[domain]: load_feature_drafter(p, target), target, base, prompts, opts)
        log.info("served %s", row(r))
        results.append(r)
    return results


def first_promotion(rounds: list[dict], start: int, end: int) -> int | None:
    """Requests after a shift (the segment is [start, end)) until the first round of the segment whose
    candidate the gate promoted (None: none was): until then the new domain is served by a head that never
    trained on it, however well the rounds learn it."""
    return next((r["after_request"] - start for r in rounds if start < r["after_request"] <= end and r["promoted"]),
                None)


def cell(value) -> str:
    """A table cell: the value, or a dash where there is none (no shift, no reference, never recovered)."""
    return "—" if value is None else str(value)


def past_row(past: dict, adapted: list[RequestStats], reference: list[RequestStats] | None) -> dict:
    """A past reference (bench.adaptation_eagle.past_references) set beside the online head that served
    the same requests and, when measured, the cross-fitted reference on them: acceptance rates, pooled."""
    window = slice(past["cut"], past["end"])
    p, o = rate(past["stats"]), rate(adapted[window])
    ref = rate(reference[window]) if reference else None
    return {"domain": past["domain"], "after": past["after"], "data": past["data"],
            "requests": f"{window.start + 1}-{window.stop}",
            "past": round(p, 3), "online": round(o, 3), "offline_unseen": None if ref is None else round(ref, 3),
            "past_vs_offline": round(p / ref, 3) if ref else None,
            "online_vs_offline": round(o / ref, 3) if ref else None}


def report(args, traffic: list[Request], frozen: list[RequestStats], adapted: list[RequestStats], rounds: list,
           out: Path, timing: dict, extra: dict | None = None) -> None:
    """`extra` (eagle): {"init": provenance; once measured, "served": tokens/s of the served versions
    (served_speed), "offline_unseen": per-request stats of the cross-fitted offline reference and
    "offline" of the one scored on its own training requests}."""
    extra = extra or {}
    domains = args.domains.split(",")
    bounds = segments(traffic, domains)
    fm = [s.mean_acceptance_length for s in frozen]
    am = [s.mean_acceptance_length for s in adapted]
    uns = extra.get("offline_unseen")
    rows = []
    for j, d in enumerate(domains):
        a, b = bounds[d]
        fs, ads = summary(frozen[a:b]), summary(adapted[a:b])
        tail = last_third(a, b)
        f_tail, a_tail = rate(frozen[tail]), rate(adapted[tail])
        row = {"domain": d, "requests": f"{a + 1}-{b}", "frozen": fs, "adapted": ads,
               "acceptance_rate_gain": round(ads["acceptance_rate"] - fs["acceptance_rate"], 3),
               "mal_gain": round(ads["mean_acceptance_length"] - fs["mean_acceptance_length"], 3),
               "recovery_requests": recovery(adapted, a, b, 16) if j > 0 else None,
               "first_promotion_requests": first_promotion(rounds, a, b) if j > 0 else None,
               "after_shift": {n: round(after_shift(adapted, a, b, n), 3) for n in AFTER_SHIFT} if j > 0 else None,
               "last_third": {"requests": f"{tail.start + 1}-{b}", "frozen": round(f_tail, 3),
                              "adapted": round(a_tail, 3), "gain": round(a_tail - f_tail, 3)}}
        if uns:
            lt, ref = row["last_third"], rate(uns[tail])
            lt["offline_unseen"], lt["offline_unseen_gain"] = round(ref, 3), round(ref - f_tail, 3)
            lt["online_vs_offline_gain"] = (round(lt["gain"] / lt["offline_unseen_gain"], 3)
                                            if lt["offline_unseen_gain"] > 0 else None)
            if j > 0:
                row["recovery_to_reference"] = recovery_to_reference(adapted, uns, a, b, 16)
            row["offline_unseen"] = summary(uns[a:b])
            row["online_vs_unseen_acceptance_rate"] = round(
                ads["acceptance_rate"] / max(row["offline_unseen"]["acceptance_rate"], 1e-9), 3)
        if "offline" in extra:
            row["offline"] = summary(extra["offline"][a:b])
            row["online_vs_offline_acceptance_rate"] = round(
                ads["acceptance_rate"] / max(row["offline"]["acceptance_rate"], 1e-9), 3)
        rows.append(row)
    past = [past_row(p, adapted, uns) for p in extra.get("past", [])]
    result = {"config": vars(args), "timing": timing, "domains": rows, "rounds": rounds, "past_references": past,
              "init": extra.get("init"), "served": extra.get("served"), "offline_steps": extra.get("offline_steps"),
              "per_request_mal": {"frozen": [round(x, 3) for x in fm], "adapted": [round(x, 3) for x in am]}}
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(result, indent=2, default=str))
    plot(fm, am, bounds, rounds, Path(f"{out}.png"), args,
         [s.mean_acceptance_length for s in uns] if uns else None)
    print(f"\n{timing}\n")
    print("| domain (requests) | frozen MAL | adapted MAL | frozen acc. rate | adapted acc. rate | gain (acc. rate) "
          "| first-token acc. frozen → adapted | recovery after shift (requests) | first promotion after shift "
          f"(requests) | acc. rate, first {' / '.join(map(str, AFTER_SHIFT))} after shift |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        f, a = r["frozen"], r["adapted"]
        print(f"| {r['domain']} ({r['requests']}) | {f['mean_acceptance_length']} | {a['mean_acceptance_length']} | "
              f"{f['acceptance_rate']} | {a['acceptance_rate']} | {r['acceptance_rate_gain']:+} | "
              f"{f['first_token_acceptance']} → {a['first_token_acceptance']} | "
              f"{cell(r['recovery_requests'])} | {cell(r['first_promotion_requests'])} | "
              f"{' / '.join(str(v) for v in r['after_shift'].values()) if r['after_shift'] else '—'} |")
    print("\nLast third of each segment, acceptance rate (gain over the frozen head):\n")
    print("| domain (requests) | frozen | online | offline, cross-fitted | online gain / offline gain "
          "| recovery to 90 % of the reference (requests) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        lt = r["last_third"]
        ref = (f"{lt['offline_unseen']} ({lt['offline_unseen_gain']:+}) | {lt['online_vs_offline_gain']}"
               if "offline_unseen" in lt else "— | —")
        print(f"| {r['domain']} ({lt['requests']}) | {lt['frozen']} | {lt['adapted']} ({lt['gain']:+}) | {ref} "
              f"| {cell(r.get('recovery_to_reference'))} |")
    if past:
        print(f"\nPast references: the initial head distilled ({extra.get('offline_steps')} steps) on the requests "
              f"before the cut (all of them, the new segment's, or all and sampled answers to the new segment's "
              f"prompts), scored on the next {PAST_SCORED} requests beside the online head that served them:\n")
        print("| domain | cut (requests after the shift) | trained on | scored on | past reference | online "
              "| offline, cross-fitted | past / cross-fitted | online / cross-fitted |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in past:
            print(f"| {r['domain']} | {r['after']} | {r['data']} | {r['requests']} | {r['past']} | {r['online']} | "
                  f"{cell(r['offline_unseen'])} | {cell(r['past_vs_offline'])} | {cell(r['online_vs_offline'])} |")
    if extra.get("served"):
        from bench.bench_do_no_harm import HEADER
        from bench.bench_do_no_harm import row as served_row

        print("\nServed, our engine, adaptive rule (k <= 8) against the target alone, side by side:\n")
        print(HEADER)
        for r in extra["served"]:
            print(served_row(r))
    print("\nrounds: " + "; ".join(f"{x['after_request']}: {x['candidate_mal']} vs {x['champion_mal']}"
                                  f"{' promoted' if x['promoted'] else ''}"
                                  f"{f' (+{n} sampled answers)' if (n := x.get('answers')) else ''}" for x in rounds))


def plot(frozen: list[float], adapted: list[float], bounds: dict, rounds: list, path: Path, args,
         offline: list[float] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = list(range(1, len(frozen) + 1))
    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=100)
    ax.plot(x, rolling(frozen, 8), label="(a) frozen initial drafter", color="tab:gray")
    ax.plot(x, rolling(adapted, 8), label="(b) adapted online", color="tab:blue")
    if offline:
        ax.plot(x, rolling(offline, 8), label="(c) distilled offline, cross-fitted (not on the request)",
                color="tab:orange", ls="--")
    for d, (a, _) in bounds.items():
        ax.axvline(a + 0.5, color="black", lw=0.6, ls=":")
        ax.text(a + 1.5, 0.98, d, transform=ax.get_xaxis_transform(), va="top", fontsize=9)
    for r in rounds:
        if r["promoted"]:
            ax.axvline(r["after_request"] + 0.5, color="tab:green", lw=0.8, alpha=0.5)
    ax.set_xlabel("requests served")
    ax.set_ylabel(f"mean acceptance length (k={args.k}, rolling 8)")
    ax.set_title("Online adaptation across domain shifts (green: candidate promoted)", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
