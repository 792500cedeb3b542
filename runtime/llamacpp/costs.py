"""Do no harm on llama-server: choose its draft rule per version from measured numbers.

llama-server cannot vary the draft length per step; it drafts up to a fixed `--spec-draft-n-max`
and stops early where the head's own probability falls under `--spec-draft-p-min`. livedraft
picks both per drafter version from
- the version's acceptance per draft position (the replay gate's, on logged traffic), and
- this engine's measured step costs on this machine, target and head architecture: the time of
  a decoding step that drafts n tokens (the head's n forwards, the target verifying n + 1
  tokens, and whatever the engine adds per step) over a step of the target alone, measured
  once with the head itself on llama-server (`measure_step_costs`) and cached,
and serves without a head when no n pays by a margin. Expected speed-up of n drafted tokens:

    (1 + A_1 + ... + A_n) / C(n),    C(n) = step time drafting n / step time of the target alone

where A_i is the share of steps whose i-th drafted token was accepted (vLLM's per-position
acceptance). The probability floor is the marginal cost of the last drafted token,
C(n) - C(n - 1): a head that is calibrated then drafts one more token only where it expects it
to pay (EAGLE-2's rule). llama-bench's n-token forward costs (`measure_forward_costs`) split
C(n) into the target's verify cost and the head's cost per drafted token, for reports.

Flash attention is chosen the same way, by measuring (`measure_flash_attn`): llama.cpp turns it on
by default, and on CPUs its kernel can cost more than the attention it replaces, for one token a
step at long contexts and for the several rows of a verify step at any context.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import LivedraftError
from runtime.llamacpp.upstream import LaunchSpec, SpecParams, Upstream

log = logging.getLogger(__name__)

MAX_N = 4  # longest draft measured and considered
MARGIN = 1.05  # drafting must promise this speed-up over the target alone, or no head is served


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one decoding step: [0] the target alone, [n] drafting n tokens (n = 1 .. MAX_N)."""

    seconds: tuple[float, ...]

    def ratio(self, n: int) -> float:
        """C(n); beyond the measured range, grows linearly from the last two points."""
        s = self.seconds
        if n < len(s):
            return s[n] / s[0]
        slope = s[-1] - s[-2] if len(s) > 1 else s[0]
        return (s[-1] + slope * (n - len(s) + 1)) / s[0]

    @property
    def max_n(self) -> int:
        return len(self.seconds) - 1


@dataclass(frozen=True)
class ForwardCosts:
    """Seconds of one target forward of n tokens (n = 1 .. len), from llama-bench."""

    seconds: tuple[float, ...]  # seconds[n - 1]

    def ratio(self, n: int) -> float:
        """T(n) / T(1); beyond the measured range, grows linearly from the last two points."""
        s = self.seconds
        if n <= len(s):
            return s[n - 1] / s[0]
        slope = (s[-1] - s[-2]) if len(s) > 1 else s[0]
        return (s[-1] + slope * (n - len(s))) / s[0]


def expected_speedup(acceptance: Sequence[float], n: int, costs: StepCosts) -> float:
    """Tokens per unit time drafting n tokens a step, over the target alone (module docstring)."""
    if n == 0:
        return 1.0
    return (1.0 + sum(_position(acceptance, i) for i in range(n))) / costs.ratio(n)


def choose_spec(acceptance: Sequence[float] | None, costs: StepCosts, *, margin: float = MARGIN
                ) -> tuple[SpecParams, float]:
    """The draft rule for a version and its expected speed-up; SpecParams(0) (no head) without
    evidence of acceptance or when no n reaches `margin`."""
    if not acceptance:
        return SpecParams(0), 1.0
    best_n, best = 0, 1.0
    for n in range(1, costs.max_n + 1):
        s = expected_speedup(acceptance, n, costs)
        if s > best:
            best_n, best = n, s
    if best < margin:
        return SpecParams(0), 1.0
    marginal = costs.ratio(best_n) - costs.ratio(best_n - 1)
    return SpecParams(best_n, round(min(max(marginal, 0.0), 0.9), 4)), best


def served_speedup(tokens: int, steps: int, drafted: int, costs: StepCosts, n_max: int) -> float:
    """What drafting gave served traffic, from llama-server's counts: tokens over the steps' cost in
    target-alone steps, a step costing 1 plus (C(n_max) - 1) / n_max per drafted token (a draft
    cut short by p-min costs its share)."""
    cost = steps + drafted * (costs.ratio(n_max) - 1.0) / max(n_max, 1)
    return tokens / cost if cost > 0 else 1.0


def acceptance_from_counts(steps: int, accepted: int, n: int) -> list[float]:
    """Per-position acceptance A_1..A_n from a fixed-n run's totals (llama-server reports no
    per-position counts): the chain A_i = b^i whose expected accepted tokens per step,
    b + ... + b^n, equal accepted / steps (solved by bisection)."""
    if steps <= 0 or n < 1:
        return []
    target = min(accepted / steps, n * 0.999999)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        b = (lo + hi) / 2
        lo, hi = (b, hi) if sum(b ** i for i in range(1, n + 1)) < target else (lo, b)
    b = (lo + hi) / 2
    return [b ** i for i in range(1, n + 1)]


def _position(acceptance: Sequence[float], i: int) -> float:
    """A_{i+1}; past the measured positions, the last measured ratio A_k / A_{k-1} continues."""
    if i < len(acceptance):
        return max(0.0, min(1.0, acceptance[i]))
    last = max(0.0, min(1.0, acceptance[-1]))
    prev = acceptance[-2] if len(acceptance) > 1 else 1.0
    ratio = min(1.0, last / prev) if prev > 0 else 0.0
    return last * ratio ** (i - len(acceptance) + 1)


# -- measuring -------------------------------------------------------------------------------

PROBE_PROMPT = list(range(100, 164))  # any 64 ids: a step's cost does not depend on the text
FLASH_ATTN_CONTEXT = 512  # the probe's prompt tokens: attention's share of a step grows with the context
FLASH_ATTN_MARGIN = 0.98  # flash attention is turned off only where that makes a step this much cheaper


def measure_step_costs(launch: Callable[[SpecParams], LaunchSpec], cache: Path, *, max_n: int = MAX_N,
                       requests: int = 3, tokens: int = 32, start_timeout_s: float = 120.0) -> StepCosts:
    """C(0..max_n) for `launch(spec)` (a llama-server with the head at `spec`, or none at
    SpecParams(0), each given `start_timeout_s` to become healthy): seconds per decoding step from
    llama-server's own timings (generation only), the median of `requests` requests per draft
    length. Cached in `cache` (a JSON file)."""
    if cache.is_file():
        return StepCosts(tuple(json.loads(cache.read_text())["seconds"]))
    log.info("measuring llama-server's step costs for drafts of 0..%d tokens (once per machine, target and "
             "head architecture)", max_n)
    seconds = [probe_step(launch(SpecParams(n, 0.0)), f"cost-probe-{n}", requests=requests, tokens=tokens,
                          start_timeout_s=start_timeout_s) for n in range(max_n + 1)]
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"seconds": seconds}))
    return StepCosts(tuple(seconds))


def measure_flash_attn(launch: Callable[[str], LaunchSpec], cache: Path, *, context: int = FLASH_ATTN_CONTEXT,
                       requests: int = 2, tokens: int = 32, start_timeout_s: float = 120.0) -> str:
    """"off" where llama-server alone (`launch("on")` against `launch("off")`) decodes a step after a
    `context`-token prompt faster with flash attention off (by FLASH_ATTN_MARGIN), else "" (llama.cpp's
    own default): the median of `requests` requests after one that warms up. Measured once and
    cached in `cache` (a JSON file with both timings)."""
    if cache.is_file():
        return json.loads(cache.read_text())["flash_attn"]
    log.info("measuring llama-server's decoding step with flash attention on and off (once per machine and target)")
    prompt = list(range(100, 100 + context))
    seconds = {fa: probe_step(launch(fa), f"flash-attn-probe-{fa}", requests=requests, tokens=tokens, prompt=prompt,
                              start_timeout_s=start_timeout_s) for fa in ("on", "off")}
    choice = "off" if seconds["off"] < FLASH_ATTN_MARGIN * seconds["on"] else ""
    log.info("llama-server here: a decoding step at a %d-token context takes %.1f ms with flash attention on, "
             "%.1f ms off: %s", context, 1000 * seconds["on"], 1000 * seconds["off"],
             "served with it off" if choice else "llama.cpp's default kept")
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"flash_attn": choice, "seconds": seconds}))
    return choice


def probe_step(launch: LaunchSpec, version: str, *, requests: int, tokens: int, prompt: list[int] = PROBE_PROMPT,
               start_timeout_s: float = 120.0) -> float:
    """Seconds per decoding step of a llama-server started with `launch` (then stopped): the median of
    `requests` requests for `tokens` tokens after `prompt`, after one that warms it up."""
    up = Upstream(launch, version=version).start(start_timeout_s)
    try:
        return statistics.median([step_seconds(up, tokens, prompt) for _ in range(requests + 1)][1:])
    finally:
        up.stop()


def step_seconds(up: Upstream, tokens: int, prompt: list[int] = PROBE_PROMPT) -> float:
    """Seconds per decoding step of a greedy request for `tokens` tokens after `prompt`, from llama-server's
    own timings (generation only; a step that accepted drafts still counts once)."""
    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0.0, "cache_prompt": False,
            "ignore_eos": True}
    conn, resp = up.open_stream({**body, "stream": False}, 120.0)
    try:
        t = json.loads(resp.read())["timings"]
    finally:
        conn.close()
    steps = max(int(t["predicted_n"]) - int(t.get("draft_n_accepted") or 0), 1)
    return float(t["predicted_ms"]) / 1000 / steps


def measure_forward_costs(bench: Path, model: Path, *, threads: int, max_tokens: int = MAX_N + 1,
                          repetitions: int = 10, timeout_s: float = 600.0) -> ForwardCosts:
    """T(1..max_tokens) for `model` with llama-bench: per n the fastest of two passes' medians (the
    first pass also warms the machine up). Raises LivedraftError when llama-bench fails."""
    sizes = ",".join(str(n) for n in range(1, max_tokens + 1))
    argv = [str(bench), "-m", str(model), "-p", sizes, "-n", "0", "-r", str(repetitions), "-o", "json"]
    if threads > 0:
        argv += ["-t", str(threads)]
    passes = []
    for _ in range(2):
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise LivedraftError(f"llama-bench failed to run ({bench}): {e}") from e
        if done.returncode != 0:
            raise LivedraftError(f"llama-bench exited with {done.returncode}: {done.stderr.strip()[-400:]}")
        passes.append(parse_bench_json(done.stdout, max_tokens))
    return ForwardCosts(tuple(min(a, b) for a, b in zip(passes[0].seconds, passes[1].seconds, strict=True)))


def parse_bench_json(text: str, max_tokens: int) -> ForwardCosts:
    """llama-bench's `-o json` rows as ForwardCosts (the median of each row's samples). Raises
    LivedraftError."""
    try:
        rows = json.loads(text)
        by_n = {int(r["n_prompt"]): statistics.median(r.get("samples_ns") or [r["avg_ns"]]) / 1e9
                for r in rows if int(r.get("n_gen", 0)) == 0}
    except (ValueError, KeyError, TypeError, statistics.StatisticsError) as e:
        raise LivedraftError(f"cannot read llama-bench's output: {e}") from e
    missing = [n for n in range(1, max_tokens + 1) if n not in by_n]
    if missing:
        raise LivedraftError(f"llama-bench gave no timing for forwards of {missing} tokens")
    return ForwardCosts(tuple(by_n[n] for n in range(1, max_tokens + 1)))


def draft_cost(step: StepCosts, forward: ForwardCosts, n: int) -> float:
    """The head's cost per drafted token in target steps, with n drafted: what a step drafting n
    costs beyond the target's own (n + 1)-token verify forward, per drafted token."""
    return (step.ratio(n) - forward.ratio(n + 1)) / n


def cost_key(*parts: object) -> str:
    """A cache key for measured costs: the parts (files by path, size and mtime) and this machine."""
    raw = []
    for p in parts:
        if isinstance(p, Path) and p.exists():
            st = p.stat()
            raw.append(f"{p.resolve()}:{st.st_size}:{int(st.st_mtime)}")
        else:
            raw.append(str(p))
    raw += [platform.machine(), _cpu_model(), str(os.cpu_count())]
    return hashlib.sha256("|".join(raw).encode()).hexdigest()[:12]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
