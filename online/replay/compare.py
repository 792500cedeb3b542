"""Drafters side by side on logged traffic (`livedraft replay`): traffic from a store or a JSONL
export, one DrafterConfig per drafter to score, each scored teacher-forced (`online.replay.engine`)
and, with a target, re-executed through the real engine for wall-clock tokens/s; a table and a
plot of the results. Model code loads inside the functions that need it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.drafter_kinds import KINDS, MODEL_FREE
from runtime.errors import LivedraftError, RequestError
from runtime.stats import RequestStats
from runtime.trace import RequestTrace

if TYPE_CHECKING:
    from online.replay.engine import ReplayReport
    from runtime.adaptive import DraftLengthConfig
    from runtime.drafters.base import Drafter
    from runtime.drafters.factory import DrafterConfig
    from runtime.loader import LoadedModel

ASSUMED_COST_RATIO = 0.1  # a model drafter's draft/verify cost ratio when nothing measured it


def load_traffic(src: str, *, limit: int | None = None, since: float | None = None, until: float | None = None,
                 tag: str | None = None) -> list[RequestTrace]:
    """Traces from a store URL or a JSONL export, oldest first, filtered the same way for both:
    created_at in [since, until), `tag`, then the most recent `limit`. Raises LivedraftError
    (a missing file, a bad URL, an unreachable or un-migrated store, a bad JSONL line)."""
    if limit is not None and limit < 1:
        raise LivedraftError(f"--limit must be >= 1, got {limit}")
    if "://" not in src:
        from online.store.jsonl import import_jsonl

        if not Path(src).is_file():
            raise LivedraftError(f"traffic file {src} does not exist (expected a .jsonl export or a store URL "
                                 "such as sqlite:///path/livedraft.db)")
        traces = [t for t in import_jsonl(src)
                  if (since is None or t.created_at >= since) and (until is None or t.created_at < until)
                  and (tag is None or t.tag == tag)]
        return traces[-limit:] if limit else traces
    store = _open_store(src)
    try:
        return store.window(limit=limit, since=since, until=until, tag=tag)
    finally:
        store.close()


def _open_store(url: str) -> Any:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    from online.store import Store

    try:
        u = make_url(url)
    except ArgumentError:
        raise LivedraftError(f"--traffic {url!r} is not a database URL "
                             "(sqlite:///path.db or postgresql+psycopg://...)") from None
    if u.get_backend_name() not in ("sqlite", "postgresql"):
        raise LivedraftError(f"--traffic {url!r} is not a store URL livedraft reads: SQLite or PostgreSQL "
                             "(sqlite:///path.db, postgresql+psycopg://...), or give a .jsonl export")
    if u.get_backend_name() == "sqlite" and u.database not in (None, "", ":memory:"):
        if not Path(u.database).expanduser().is_file():
            raise LivedraftError(f"no store at {u.database}: the SQLite file does not exist")
    store = Store.open(url, upgrade=False)  # reading only: never migrate someone else's database
    if store.revision() is None:
        store.close()
        raise LivedraftError(f"{store.url} is not a livedraft store (no schema): check the URL or run "
                             "`livedraft db upgrade`")
    return store


# --- drafters and scoring ------------------------------------------------------------------


@dataclass
class DrafterRun:
    """One drafter's results: the teacher-forced report, and the live re-execution when asked."""

    label: str
    kind: str
    report: ReplayReport
    cost_source: str  # "given", "measured", "logged", "model-free" or "assumed"
    live: RequestStats | None = None
    live_speedup: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"label": self.label, "kind": self.kind, **self.report.to_dict(), "cost_ratio_source": self.cost_source}
        if self.live is not None:
            out["live"] = {**self.live.to_dict(), "speedup_vs_target": _round(self.live_speedup)}
        return out


def drafter_specs(values: list[str], kind: str) -> list[DrafterConfig]:
    """One DrafterConfig per --drafter; a value naming a model-free kind (and no existing path) is that kind."""
    from runtime.drafters.factory import DrafterConfig

    if kind not in KINDS:
        raise LivedraftError(f"unknown --drafter-kind {kind!r}: choose one of {sorted(KINDS)}")
    if not values:
        if kind not in MODEL_FREE:
            raise LivedraftError("give at least one --drafter (a model directory, or a kind such as lookup)")
        return [DrafterConfig(kind=kind)]
    from runtime.drafters.factory import drafter_kind

    specs = []
    for v in values:
        if v in KINDS and not KINDS[v].learned and not Path(v).exists():
            specs.append(DrafterConfig(kind=v))
        elif kind == "model" and Path(v).is_dir():
            specs.append(DrafterConfig(kind=drafter_kind(v), path=v))  # a model or an eagle directory
        else:
            specs.append(DrafterConfig(kind=kind, path=None if kind in MODEL_FREE else v))
    return specs


def _label(spec: DrafterConfig) -> str:
    return spec.kind if spec.path is None else spec.path


def cost_ratio_for(spec: DrafterConfig, given: float | None, traces: list[RequestTrace], version: str,
                   live: RequestStats | None) -> tuple[float, str]:
    """The draft/verify cost ratio used for the estimated speedup, and where it came from."""
    if spec.kind in MODEL_FREE:
        return 0.0, "model-free"
    if given is not None:
        return given, "given"
    if live is not None and live.drafted and live.steps and live.verify_s > 0:
        return (live.draft_s / live.drafted) / (live.verify_s / live.steps), "measured"
    logged = _logged_ratio([t for t in traces if t.drafter_version == version])
    if logged is not None:
        return logged, "logged"
    return ASSUMED_COST_RATIO, "assumed"


def _logged_ratio(traces: list[RequestTrace]) -> float | None:
    """(draft seconds per drafted token) / (verify seconds per step) over traces this drafter served."""
    draft_s = sum(t.timings.draft_s for t in traces)
    verify_s = sum(t.timings.verify_s for t in traces)
    drafted = sum(len(s.drafted) for t in traces for s in t.steps)
    steps = sum(len(t.steps) for t in traces)
    if not (drafted and steps and verify_s > 0 and draft_s > 0):
        return None
    return (draft_s / drafted) / (verify_s / steps)


def execute(traces: list[RequestTrace], target: LoadedModel, drafter: Drafter,
            length: DraftLengthConfig) -> RequestStats:
    """Re-runs every trace's request (its prompt and sampling parameters) through the engine.
    Requests the target cannot serve (too long) are skipped."""
    from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine

    engine = SpeculativeEngine.for_model(target, drafter, EngineConfig(draft=length, topk_logprobs=0))
    base_eos = set(engine.eos_ids)
    if traces:  # warm-up (lazy init, allocator, caches) so the first timed request is not penalised
        try:
            engine.generate(traces[0].prompt_ids, SamplingParams(max_new_tokens=4))
        except RequestError:
            pass
    total = RequestStats(requests=0)
    for t in traces:
        # A logged stop on a token outside the target's EOS set (a custom stop id) stops here too.
        engine.eos_ids = base_eos | ({t.output_ids[-1]} if t.finish_reason == "stop" and t.output_ids else set())
        params = SamplingParams(max(t.max_new_tokens, len(t.output_ids), 1), t.temperature, t.top_p, t.seed)
        try:
            total = total.merge(engine.generate(t.prompt_ids, params, request_id=t.request_id).stats)
        except RequestError:
            continue
    return total


def score(traces: list[RequestTrace], specs: list[DrafterConfig], length: DraftLengthConfig,
          target: LoadedModel | None, cost_ratio: float | None, cache_dir: str) -> list[DrafterRun]:
    from online.replay.engine import ReplayReport, replay_traces
    from runtime.drafters.factory import build_drafter
    from runtime.drafters.none import NoDrafter

    vocab = target.vocab_size if target is not None else None
    baseline = execute(traces, target, NoDrafter(), length) if target is not None else None
    runs = []
    for spec in specs:
        drafter = build_drafter(spec, target, cache_dir)
        features = None
        if drafter.uses_features:  # an eagle head: recompute the target's features teacher-forced
            from online.trainer.features import FeatureExtractor

            extractor = FeatureExtractor(target, drafter.config.aux_layers)
            features = lambda t, ex=extractor: ex.one(t.prompt_ids + t.output_ids).features  # noqa: E731
        # Without --target, replay_traces sizes the vocabulary from the drafter or the traffic itself.
        report = replay_traces(traces, drafter, length=length, vocab_size=vocab, features=features,
                               **({"cost_ratio": cost_ratio} if cost_ratio is not None else {}))
        live = live_speedup = None
        if target is not None:
            live = execute(traces, target, build_drafter(spec, target, cache_dir), length)
            live_speedup = live.tokens_per_s / baseline.tokens_per_s if baseline.tokens_per_s else None
        report.cost_ratio, source = cost_ratio_for(spec, cost_ratio, traces, report.drafter, live)
        runs.append(DrafterRun(_label(spec), spec.kind, report, source, live, live_speedup))
    if baseline is not None:
        runs.append(DrafterRun("(target alone)", "none", ReplayReport("none", RequestStats(requests=0)),
                               "model-free", baseline, 1.0))
    return runs


# --- output --------------------------------------------------------------------------------


def _round(x: float | None, n: int = 4) -> float | None:
    return None if x is None or math.isnan(x) else round(x, n)


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)  # noqa: E731
                               for i, (c, w) in enumerate(zip(r, widths, strict=True)))
    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


def render(runs: list[DrafterRun], summary: dict[str, Any]) -> str:
    scored = [r for r in runs if r.label != "(target alone)"]
    header = ["drafter", "version", "requests", "mean acc len", "acc rate", "alpha", "per-position acceptance",
              "cost ratio", "est speedup"]
    rows = [[r.label, r.report.drafter, str(r.report.stats.requests), _fmt(r.report.stats.mean_acceptance_length),
             _fmt(r.report.stats.acceptance_rate), _fmt(r.report.stats.alpha),
             " ".join(f"{a:.2f}" for a in r.report.stats.per_position_acceptance) or "-",
             f"{r.report.cost_ratio:.3f} ({r.cost_source})", _fmt(r.report.est_speedup, ".2f") + "x"] for r in scored]
    out = [f"traffic: {summary['source']}: {summary['traces']} traces, {summary['greedy']} greedy scored "
           f"teacher-forced, {summary['skipped_sampled']} sampled skipped", "", _table(header, rows)]
    tags = sorted({tag for r in scored for tag in r.report.per_tag})
    if len(tags) > 1 or (tags and tags != ["(none)"]):
        trows = [[tag, r.label, str(s.requests), _fmt(s.mean_acceptance_length), _fmt(s.acceptance_rate)]
                 for tag in tags for r in scored if (s := r.report.per_tag.get(tag)) is not None]
        out += ["", "per tag:", _table(["tag", "drafter", "requests", "mean acc len", "acc rate"], trows)]
    srows = [[r.label, src, str(v.steps), str(v.drafted), str(v.accepted), _fmt(v.acceptance_rate)]
             for r in scored for src, v in sorted(r.report.per_source.items())]
    if srows:
        out += ["", "per draft source:",
                _table(["drafter", "source", "steps", "drafted", "accepted", "acc rate"], srows)]
    live = [r for r in runs if r.live is not None]
    if live:
        lrows = [[r.label, str(r.live.requests), str(r.live.output_tokens), _fmt(r.live.mean_acceptance_length),
                  _fmt(r.live.tokens_per_s, ".1f"), _fmt(r.live_speedup, ".2f") + "x"] for r in live]
        out += ["", "re-executed through the target (wall clock):",
                _table(["drafter", "requests", "tokens", "mean acc len", "tokens/s", "speedup"], lrows)]
    return "\n".join(out)


def plot(runs: list[DrafterRun], path: str) -> None:
    """Acceptance per position (left) and mean acceptance length per tag (right), one series per drafter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scored = [r for r in runs if r.label != "(target alone)"]
    tags = sorted({tag for r in scored for tag in r.report.per_tag})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(scored))
    for i, r in enumerate(scored):
        acc = r.report.stats.per_position_acceptance
        ax1.plot(range(1, len(acc) + 1), acc, marker="o", label=r.label)
        ax2.bar([j + i * width for j in range(len(tags))],
                [r.report.per_tag[t].mean_acceptance_length if t in r.report.per_tag else 0.0 for t in tags],
                width, label=r.label)
    ax1.set(xlabel="draft position", ylabel="acceptance (per step)", title="acceptance per position", ylim=(0, 1))
    ax1.xaxis.get_major_locator().set_params(integer=True)
    ax2.set(ylabel="mean acceptance length", title="per tag")
    ax2.set_xticks([j + width * (len(scored) - 1) / 2 for j in range(len(tags))], tags)
    ax1.legend()
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
