"""Draft length per step: fixed k, or adaptive — the k that maximises expected tokens per second.

Adaptive mode picks, each step, the k in 0..k_max (0 = no drafting) with the most
expected tokens per second of this step:

    E(k) / (draft_s(k) + verify_s(k + 1)),   E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j

where a_j is the estimated probability that draft token j is accepted given the ones
before it were (this request's counts, Beta-smoothed toward the drafter version's
counts over all requests so far), and the two costs are measured online: seconds of a
target forward by the number of tokens it fed, seconds of a drafter's propose by the
number of tokens it drafted (`CostModel`). A drafter that does not pay is switched off
(k = 0) and probed with one draft token every `probe_every` steps, so a drafter that
starts paying (a hot-swapped version, a repetitive stretch for a suffix cache) is
noticed. Probes are spaced further apart when they are dear: their extra seconds, spread over
the steps between them, stay under `probe_budget` of a step that drafts nothing. Drafting must
beat drafting nothing by `margin` (5 %) of expected tokens per second: the rates are estimates,
and picking the best of noisy estimates favours whichever is over-estimated, so at break-even
the rule keeps the sure option (a head right 14 % of the time on an AVX2 CPU, where verifying two
tokens costs ~1.1 steps, drafted on 40 % of steps at a small loss without it). Once a proven
version's best k is 0, the request keeps k = 0 for `recheck_every` steps before it weighs every
k again (probes stay on their schedule), twice as long each time the answer stays "nothing" (up to
`RECHECK_GROWTH` times), and `recheck_every` again once a drafted token is accepted: on a small
target the weighing itself is a few percent of a step, and a decision that did not draft changes
no counts (between probes only other requests' drafts and the costs' drift move the estimates).

Cold start bets on nothing: a version with fewer than `min_evidence` drafted positions (over
all its requests) drafts only probes: one token at a request's first step (while that token is
accepted at least half the time), then back to back and twice as wide while they are fully
accepted (a slow start), else every `probe_every` steps; nothing is drafted before the target's
cost is measured; an unmeasured draft cost is the last measured version's, else one target step
per token, never free. Costs carry across requests and swaps. A hot-swapped version of the same
drafter class (a registry version the replay gate promoted over the one it replaces) also starts
from its predecessor's acceptance, weighted as `min_evidence` positions, so its own counts
outweigh it within a few requests: k is weighed from it at once, and the cold start's probes run
as well until the version has its own evidence (a successor of a switched-off version is noticed
as fast as a cold one). Probing a promotion from one token only made it serve short drafts for
its first requests — and the rollback guard, which compares mean acceptance length with the
predecessor's, rolled good versions back for it.

In a batch the widths are padded to the longest row, so the batch shares one
cap K, chosen the same way (margin included) over the sum of the rows' expected tokens: as the batch
grows, verifying another position costs more rows of compute and the best K shrinks.

A drafter with a part whose drafts are next to free (a hybrid's suffix cache) offers its draft before
the rule decides (`Offer`): the offer is weighed first, by the same rule with its own counts (all
offered drafts over all requests, cold start included) and the verify cost alone, and a row that takes
it drafts nothing else; the other rows weigh the drafter as above, with the drafter's own counts and
cost. One rule over both had priced the suffix cache's drafts at the model's cost and acceptance:
once the model did not pay, the suffix cache drafted on probes only (on the story model's demo
traffic, 0.86x of fixed k = 4 against 1.10x with offers).

A drafter with probabilities can also stop early on its own once its top probability at
the next position falls under `min_confidence` (SpecDec++ / HF
`assistant_confidence_threshold`). Off by default (0): the rule above already prices every
drafted token, and the stop on top of it cut positions that paid — the EAGLE-3 head's
confidence is not calibrated (docs/benchmarks.md: 8-11 % fewer tokens/s with 0.3, side by side).

Seeded sampled requests promise the same output every time, alone or batched, so their
k must not depend on timings or on other requests: they use the acceptance-only rule
(`deterministic_k`: the per-request reach-probability cap).
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class DraftLengthConfig:
    k: int = 4  # fixed k, and the upper bound in adaptive mode
    adaptive: bool = False
    min_confidence: float = 0.0  # adaptive: a drafter stops under this top probability (module docstring)
    min_reach_prob: float = 0.2  # seeded sampled requests: cap k where reaching it gets this unlikely
    prior: float = 1.0  # Beta(prior, prior) smoothing of acceptance counts
    prior_strength: float = 4.0  # pseudo-steps of the drafter version's acceptance a request starts from
    probe_every: int = 8  # adaptive: with k = 0 best, draft one token every this many steps
    min_evidence: int = 16  # adaptive: drafted positions a version needs before k > 1 (module docstring)
    probe_budget: float = 0.02  # adaptive: probes' extra seconds, spread over the steps between them, per step
    recheck_every: int = 4  # adaptive: steps before a proven version's "draft nothing" is re-decided (doubling)
    margin: float = 0.05  # adaptive: drafting must beat drafting nothing by this share of expected tokens/s

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"draft length k must be >= 0, got {self.k}")
        if not 0.0 <= self.min_confidence < 1.0:
            raise ValueError(f"min_confidence must be in [0, 1), got {self.min_confidence}")
        if not 0.0 <= self.min_reach_prob < 1.0:
            raise ValueError(f"min_reach_prob must be in [0, 1), got {self.min_reach_prob}")
        if self.probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {self.probe_every}")
        if self.min_evidence < 0:
            raise ValueError(f"min_evidence must be >= 0, got {self.min_evidence}")
        if not self.probe_budget > 0.0:
            raise ValueError(f"probe_budget must be > 0, got {self.probe_budget}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {self.margin}")


class Curve:
    """Seconds as a function of tokens: an exponential moving average per measured token
    count, read between measured points by linear interpolation and beyond them by the
    mean slope from the first to the last (never negative). With one point (x0, y0): y0 * (1 + slope * (x - x0)) when a
    `one_point_slope` is given (a prior that lets the engine try wider steps and measure
    them), else proportionally from the origin."""

    def __init__(self, decay: float = 0.2, one_point_slope: float | None = None) -> None:
        self.decay, self.one_point_slope = decay, one_point_slope
        self.xs: list[int] = []
        self.ys: list[float] = []
        self._floor: list[float] = []  # running maximum of ys: more tokens never cost less

    def record(self, x: int, seconds: float) -> None:
        """One measurement of x > 0 tokens (x <= 0 is ignored: nothing was done)."""
        if x <= 0:
            return
        i = bisect.bisect_left(self.xs, x)
        if i < len(self.xs) and self.xs[i] == x:
            self.ys[i] += self.decay * (seconds - self.ys[i])
        else:
            self.xs.insert(i, x)
            self.ys.insert(i, seconds)
        self._floor = list(itertools.accumulate(self.ys, max))

    def __call__(self, x: int) -> float | None:
        """Estimated seconds for x tokens, never less than what fewer tokens were measured at (a
        forward over more tokens does not cost less: on a noisy machine the two-token average can
        dip under the one-token one, and the rule then drafts a token that looks free); None
        before any measurement."""
        value = self._read(x)
        if value is None or x <= 0:
            return value
        below = bisect.bisect_right(self.xs, x)
        return max(value, self._floor[below - 1]) if below else value

    def _read(self, x: int) -> float | None:
        xs, ys = self.xs, self.ys
        if not xs:
            return None
        if x <= 0:
            return 0.0
        i = bisect.bisect_left(xs, x)
        if i < len(xs) and xs[i] == x:
            return ys[i]
        if len(xs) == 1:
            if self.one_point_slope is not None:
                return ys[0] * (1.0 + self.one_point_slope * (x - xs[0]))
            return ys[0] * x / xs[0]
        if 0 < i < len(xs):
            lo, hi = i - 1, i
        else:
            # beyond the measured range: the mean slope over it (first to last point), not that
            # of two neighbouring noisy points. Under-estimating a wide step is self-correcting
            # (the engine tries it and measures it); over-estimating it would rule it out forever.
            lo, hi = 0, len(xs) - 1
        slope = max((ys[hi] - ys[lo]) / (xs[hi] - xs[lo]), 0.0)
        return max(ys[lo] + slope * (x - xs[lo]), 0.0)


@dataclass
class CostModel:
    """Measured step costs: the target by tokens fed per forward (rows x padded width), each
    drafter version by tokens drafted per propose (summed over rows; key "" stands for any
    version not measured yet: `synthetic`). An unmeasured version is never free (`draft_seconds`)."""

    # until a second width is measured, verifying one more token is assumed to cost 10 % more
    verify: Curve = field(default_factory=lambda: Curve(one_point_slope=0.1))
    draft: dict[str, Curve] = field(default_factory=dict)
    last_draft: str | None = None  # the version whose draft cost was measured last

    @classmethod
    def synthetic(cls, draft_ratio: float, verify_slope: float = 0.1) -> CostModel:
        """Costs in units of a one-token target step: verifying n tokens costs
        1 + verify_slope (n - 1), a draft token draft_ratio (replay, tests: deterministic)."""
        m = cls()
        m.verify.record(1, 1.0)
        m.verify.record(2, 1.0 + verify_slope)
        m.draft[""] = Curve()
        m.draft[""].record(1, draft_ratio)
        return m

    def record_verify(self, tokens: int, seconds: float) -> None:
        self.verify.record(tokens, seconds)

    def record_draft(self, version: str, tokens: int, seconds: float) -> None:
        if tokens <= 0:
            return  # nothing drafted: no sample (and no "last measured" version)
        self.draft.setdefault(version, Curve()).record(tokens, seconds)
        self.last_draft = version

    def draft_seconds(self, version: str, tokens: int) -> float | None:
        """Seconds for `version` to draft `tokens`: its own curve; until it has one, "" (synthetic),
        then the last measured version's; with none, one one-token target step per drafted token
        (conservative: a probe measures the real cost). None before the target was measured."""
        if tokens <= 0:
            return 0.0
        for key in (version, "", self.last_draft):
            curve = self.draft.get(key) if key is not None else None
            if curve is not None and curve.xs:
                return curve(tokens)
        one = self.verify(1)
        return None if one is None else one * tokens

    def verify_seconds(self, k: int) -> float | None:
        """One row verifying k drafted tokens (k + 1 fed); None until the target was measured."""
        return self.verify(k + 1)

    def step_seconds(self, version: str, rows: int, k: int, drafted: int | None = None) -> float | None:
        """A step of `rows` requests verifying k drafted tokens each (padded to k), of which `version`
        drafted `drafted` in all (default rows x k; fewer where rows draft less or took an offer);
        None until the target was measured."""
        v = self.verify(rows * (k + 1))
        if v is None:
            return None
        return v + (self.draft_seconds(version, rows * k if drafted is None else drafted) or 0.0)


RECHECK_GROWTH = 8  # a proven version's "draft nothing" waits at most this many recheck_every steps
FIRST_PROBES = 4  # an unproven version's first-token probes before its hit rate decides whether new requests probe


class AcceptanceCounts:
    """Per position i: drafts that reached token i (all before it accepted), and those whose
    token i was accepted. A hot-swapped version's counts also hold its predecessor's as a prior
    (`inherited`, scaled): the estimates read it, the cold-start rules (proven, first-step probes)
    count the version's own drafts only."""

    def __init__(self, inherited: AcceptanceCounts | None = None) -> None:
        self.reached: list[float] = []  # float in a scaled copy (`scaled`)
        self.passed: list[float] = []
        self.inherited = inherited

    def update(self, drafted: int, accepted: int) -> None:
        n = min(drafted, accepted + 1)
        if len(self.reached) < n:
            self.reached += [0] * (n - len(self.reached))
            self.passed += [0] * (n - len(self.passed))
        for i in range(n):
            self.reached[i] += 1
            if i < accepted:
                self.passed[i] += 1

    def get(self, i: int) -> tuple[float, float]:
        """The version's own counts at position i."""
        return (self.reached[i], self.passed[i]) if i < len(self.reached) else (0, 0)

    def estimate(self, i: int) -> tuple[float, float]:
        """Counts at position i for estimating acceptance: the version's own plus the inherited prior."""
        r, p = self.get(i)
        if self.inherited is not None:
            ri, pi = self.inherited.estimate(i)
            r, p = r + ri, p + pi
        return r, p

    def scaled(self, evidence: float) -> AcceptanceCounts:
        """The estimate's counts (own and inherited) with the same per-position rates, weighted as at
        most `evidence` drafted positions in all: a prior its own counts soon outweigh."""
        n = max(len(self.reached), len(self.inherited.reached) if self.inherited is not None else 0)
        counts = [self.estimate(i) for i in range(n)]
        total = sum(r for r, _ in counts)
        f = min(1.0, evidence / total) if total else 0.0
        out = AcceptanceCounts()
        out.reached, out.passed = [r * f for r, _ in counts], [p * f for _, p in counts]
        return out


class DraftLengthController:
    """Per-request state; the engine asks `best_k`/`fixed_k` before drafting and calls `update`
    after verification. `shared` is the drafter version's counts over all its requests."""

    def __init__(self, config: DraftLengthConfig, shared: AcceptanceCounts | None = None) -> None:
        self.config = config
        self.own = AcceptanceCounts()
        self.shared = shared
        self.since_draft = 0  # steps since this request last drafted
        self.last_hit = False  # this request's last step drafted and every drafted token was accepted
        self.last_drafted = 0  # tokens this request's last step drafted
        self.idle_for = 0  # steps left before a proven version's "draft nothing" is weighed again
        self.recheck = config.recheck_every  # the next such wait (module docstring)
        self.interval: int | None = None  # this stretch without drafting's probe interval, once asked for

    @property
    def min_confidence(self) -> float:
        return self.config.min_confidence if self.config.adaptive else 0.0

    def acceptances(self, n: int) -> list[float]:
        """Estimated P(draft token i accepted | tokens before it accepted), i < n: this request's
        counts, smoothed toward the drafter version's, smoothed toward position i - 1's estimate
        (0.5 for the first): a position never drafted yet is assumed as good as the one before,
        so drafting one token further is tried once the position before it has paid."""
        prior, strength = self.config.prior, self.config.prior_strength
        out, prev = [], 0.5
        for i in range(n):
            mean = prev
            if self.shared is not None:
                r, p = self.shared.estimate(i)
                mean = (p + 2 * prior * prev) / (r + 2 * prior)
            r, p = self.own.get(i)
            prev = (p + strength * mean) / (r + strength)
            out.append(prev)
        return out

    def expected_tokens(self, k_max: int) -> list[float]:
        """E(k) for k = 0..k_max: tokens a step yields (accepted drafts + the bonus/correction)."""
        out, reach, total = [1.0], 1.0, 1.0
        for a in self.acceptances(k_max):
            reach *= a
            total += reach
            out.append(total)
        return out

    def fixed_k(self, remaining: int) -> int:
        """Fixed mode: k; deterministic adaptive mode: k capped where reaching a position gets
        less likely than min_reach_prob (this request's own counts only)."""
        k = min(self.config.k, max(remaining, 0))
        if not self.config.adaptive:
            return k
        prior, reach = self.config.prior, 1.0
        for i in range(k):
            r, p = self.own.get(i)
            reach *= (p + prior) / (r + 2 * prior)
            if reach < self.config.min_reach_prob:
                return max(i, 1)
        return k

    @property
    def version_counts(self) -> AcceptanceCounts:
        """All the version's requests' counts (the shared counts a request starts from), or this
        request's own without them."""
        return self.shared if self.shared is not None else self.own

    def evidence(self) -> int:
        """Drafted positions the target has judged for this version."""
        return sum(self.version_counts.reached)

    def proven(self) -> bool:
        return self.evidence() >= self.config.min_evidence

    def weighs(self) -> bool:
        """k is weighed from the estimates: the version is proven, or inherited a hot-swapped
        predecessor's acceptance (an unproven one still probes as a cold start would)."""
        return self.proven() or (self.shared is not None and self.shared.inherited is not None)

    def wants_probe(self, every: Callable[[], int] | None = None) -> bool:
        """A probe is due (`probe_width` tokens): `every()` (default probe_every) steps without
        drafting; for a version still unproven also at once after a probe was accepted (evidence,
        gathered while it pays) and at a request's first step until the version's first drafted
        token is judged (FIRST_PROBES) and while it is accepted at least as often as not — a
        drafter that keeps missing stops probing every new request (a model drafter's first
        draft in a request runs the whole prompt through it)."""
        if not self.proven() and (self.last_hit or (not self.own.reached and self._first_token_pays())):
            return True
        if self.since_draft + 1 < self.config.probe_every:  # never sooner, however cheap probes are
            return False
        if every is None:
            return True
        if self.interval is None:  # once per stretch without drafting: the costs it reads drift slowly
            self.interval = every()
        return self.since_draft + 1 >= self.interval

    def _first_token_pays(self) -> bool:
        reached, passed = self.version_counts.get(0)
        return reached < FIRST_PROBES or 2 * passed >= reached

    def update(self, drafted: int, accepted: int) -> None:
        self.own.update(drafted, accepted)
        if self.shared is not None:
            self.shared.update(drafted, accepted)
        self.since_draft = 0 if drafted else self.since_draft + 1
        if drafted:
            self.interval = None
        if accepted:  # news: weigh a "draft nothing" again soon
            self.recheck = self.config.recheck_every
        self.last_hit = drafted > 0 and accepted >= drafted
        self.last_drafted = drafted

    def probe_width(self, cap: int) -> int:
        """An unproven version's probe: one token, doubled after each fully accepted probe (a slow
        start: a good new version reaches full k in a few steps, a bad one never drafts past 1)."""
        return max(1, min(cap, 2 * self.last_drafted if self.last_hit and not self.proven() else 1))


@dataclass
class Offer:
    """A draft that cost next to nothing to make (a hybrid drafter's suffix cache), offered before the
    rule decides: `length` tokens, weighed with `controller` (the counts of offered drafts) and the
    target's verify cost alone."""

    controller: DraftLengthController
    length: int


def choose_lengths(controllers: list[DraftLengthController], remaining: list[int], versions: list[str],
                   costs: CostModel) -> list[int]:
    """Adaptive k for each request of a batch without offers (`choose_with_offers`)."""
    return choose_with_offers(controllers, remaining, versions, costs, [None] * len(controllers))[0]


def choose_with_offers(controllers: list[DraftLengthController], remaining: list[int], versions: list[str],
                       costs: CostModel, offers: list[Offer | None]) -> tuple[list[int], list[bool]]:
    """Adaptive k for each request of a batch (see the module docstring), and whether the row takes its
    offer (the first k tokens of it) rather than the drafter's draft: one cap K for the batch maximising
    expected tokens per second; a request whose own best k is 0 drafts nothing unless its probe is due,
    and one whose version is unproven drafts its probe only. An offer is weighed first, by the same rule
    with the offered drafts' counts and no draft cost (it is made already); one not worth verifying leaves
    the row to the drafter. Before the target's cost is measured, probes only (that step measures it)."""
    n = len(controllers)
    caps = [min(c.config.k, max(r, 0)) for c, r in zip(controllers, remaining, strict=True)]
    curves: list[list[float]] = [[1.0]] * n  # E(k) per row, computed where k > 0 is weighed
    version = versions[0] if len(set(versions)) == 1 else ""
    own, taken, probing = [], [False] * n, 0  # probing: the widest probe due this step
    for i, (c, cap, v, offer) in enumerate(zip(controllers, caps, versions, offers, strict=True)):
        if offer is not None:
            k, probe = _offer_length(offer, min(cap, offer.length), costs)
            if k:
                curves[i], taken[i] = offer.controller.expected_tokens(k), True
                probing = max(probing, k if probe else 0)
                own.append(k)
                continue
        best, weighs = 0, c.weighs()  # an unproven version without inherited acceptance drafts its probes only
        if weighs and c.idle_for > 0:  # decided "draft nothing" a few steps ago: E(0) = 1 is all it needs
            c.idle_for -= 1
        elif weighs:
            curves[i] = c.expected_tokens(cap)
            best = _argmax_rate(curves[i], lambda k, v=v: costs.step_seconds(v, 1, k), c.config.margin)
            if best == 0:
                c.idle_for = c.recheck - 1
                c.recheck = min(2 * c.recheck, RECHECK_GROWTH * c.config.recheck_every)
        if best == 0 and cap > 0 and c.wants_probe(lambda c=c, v=v: _probe_interval(c.config, costs, v)):
            best = c.probe_width(cap)
            probing = max(probing, best)
            if len(curves[i]) == 1:  # not weighed above this step
                curves[i] = c.expected_tokens(cap)
        own.append(best)
    top = max(own, default=0)
    if top == 0:
        return own, taken

    def batch_rate(k_cap: int) -> float | None:
        # the drafter drafts its own rows' tokens only: an offer taken costs nothing more to draft
        drafted = sum(min(k, k_cap) for k, t in zip(own, taken, strict=True) if not t)
        secs = costs.step_seconds(version, n, k_cap, drafted)
        if secs is None or secs <= 0:
            return None
        return sum(curve[min(k, k_cap)] for curve, k in zip(curves, own, strict=True)) / secs

    rates = [batch_rate(k) for k in range(top + 1)]
    if any(r is None for r in rates):  # the target's cost not measured yet: probes only
        return [min(k, 1) for k in own], taken
    # the batch's cap under the same margin: rows that each beat it alone may only break even together
    k_cap = max(_best_rate(rates, max(c.config.margin for c in controllers)), probing)  # type: ignore[arg-type]
    ks = [min(k, k_cap) for k in own]
    return ks, [t and k > 0 for t, k in zip(taken, ks, strict=True)]


def _offer_length(offer: Offer, cap: int, costs: CostModel) -> tuple[int, bool]:
    """Tokens of an offer worth verifying — the best k by expected tokens per second of verifying, with
    the margin — and whether they are a probe: while unproven, and once its best k is 0, an offer is
    probed as a drafter is (the cold start's slow start, then one token on the probe schedule), and
    the batch's cap keeps a probe as it keeps a drafter's."""
    c = offer.controller
    if cap <= 0:
        return 0, False
    if c.weighs():
        best = _argmax_rate(c.expected_tokens(cap), costs.verify_seconds, c.config.margin)
        if best:
            return best, False
    if c.wants_probe():
        return c.probe_width(cap), True
    return 0, False


def _probe_interval(config: DraftLengthConfig, costs: CostModel, version: str) -> int:
    """Steps between probes: probe_every, stretched until a probe's extra seconds over the steps
    between probes are at most probe_budget of a step without drafting (at most 16 x probe_every).
    Until the version's own draft cost is measured, probe_every: its first probe measures it."""
    base, probe = costs.step_seconds(version, 1, 0), costs.step_seconds(version, 1, 1)
    if version not in costs.draft or base is None or probe is None or base <= 0:
        return config.probe_every
    every = math.ceil((probe - base) / (config.probe_budget * base))
    return min(max(config.probe_every, every), 16 * config.probe_every)


def _argmax_rate(curve: list[float], seconds: object, margin: float = 0.0) -> int:
    """The k with the most expected tokens per second (`curve[k]` tokens in `seconds(k)`; 0 when
    a cost is not measured: bet on nothing), by `_best_rate`."""
    rates = []
    for k, tokens in enumerate(curve):
        s = seconds(k)  # type: ignore[operator]
        if s is None or s <= 0:
            return 0
        rates.append(tokens / s)
    return _best_rate(rates, margin)


def _best_rate(rates: list[float], margin: float) -> int:
    """The index of the highest rate, index 0 (drafting nothing) counted `margin` higher than it
    is: k > 0 only where it beats k = 0 by more than `margin` of k = 0's rate (the estimates are
    noisy, and the maximum of noisy estimates is biased upwards: at break-even the rule takes the
    sure option)."""
    best, best_rate = len(rates) - 1, -1.0
    for k, rate in enumerate(rates):
        rate = rate * (1.0 + margin) if k == 0 else rate
        if rate > best_rate + 1e-12:
            best, best_rate = k, rate
    return best
