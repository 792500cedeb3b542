"""Wiring for `livedraft serve --engine llama-server` (and `up`): a supervised llama-server behind
livedraft's HTTP server, fed the registry's heads as GGUF files, hot-swapped process by process.

A drafter version becomes an *upstream*: its head exported to llama.cpp's EAGLE-3 GGUF, the draft
rule chosen for it (runtime/llamacpp/costs.py: the version's replay acceptance per position
against this machine's measured forward costs; no head where drafting does not pay), and a
llama-server started with both. A swap starts the new upstream, waits for its /health, routes
new requests to it, and keeps the old one as the rollback target until the next swap, when it
is drained and stopped. Nothing downstream of the stream changes: the traces look like ours.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from online.commands.engine import llamacpp_locations
from online.config import FLASH_ATTN, Config, ConfigError
from runtime.errors import LivedraftError
from runtime.hotswap import DrafterRef, DrafterSource, HotSwapper
from runtime.llamacpp.binary import find_llama_server
from runtime.llamacpp.costs import (
    FLASH_ATTN_CONTEXT,
    StepCosts,
    choose_spec,
    cost_key,
    measure_flash_attn,
    measure_step_costs,
    served_speedup,
)
from runtime.llamacpp.upstream import LaunchSpec, SpecParams, Upstream, UpstreamError
from runtime.llamacpp.worker import LlamaServerWorker
from runtime.loader import PACKAGED, resolve_model_dir
from runtime.serve.server import CompletionServer, job_queue
from runtime.slot import DrafterSlot

log = logging.getLogger(__name__)
NO_HEAD = SpecParams(0)


@dataclass
class LlamaTarget:
    """The target as llama-server loads it (`gguf`) and as livedraft reads it (`hf_dir`: the
    tokenizer, the vocabulary, and the trainer's features)."""

    gguf: Path
    hf_dir: Path
    model_id: str


def resolve_llama_target(spec: str, cfg: Config) -> LlamaTarget:
    """`--target` for llama-server: a .gguf file as it is; a Hugging Face directory, or a packaged
    name, written once to GGUF (engine.target_type, f32 by default: a head pays far more often
    where verifying n tokens costs little more than one) with llama.cpp's converter — a packaged
    name falls back to its own (quantized) GGUF where no converter is installed."""
    from runtime.llamacpp.binary import find_converter
    from runtime.llamacpp.convert import hf_to_gguf
    from runtime.loader import _packaged_file

    hf_dir, model_id = resolve_model_dir(spec, cfg.models.cache_dir)
    path = Path(spec).expanduser()
    if spec in PACKAGED:
        try:
            find_converter(llamacpp_locations(cfg))
        except LivedraftError:
            log.warning("no llama.cpp converter installed: llama-server serves %s's packaged GGUF", spec)
            return LlamaTarget(_packaged_file(spec), hf_dir, model_id)
        path = hf_dir
    elif path.is_file():
        return LlamaTarget(path, hf_dir, model_id)
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:10]
    out = Path(cfg.models.cache_dir).expanduser() / "gguf" / f"{path.name}-{key}-{cfg.engine.target_type}.gguf"
    if not out.is_file():
        log.warning("writing %s as GGUF (%s) for llama-server: %s (once)", path, cfg.engine.target_type, out)
        tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")  # a conversion that fails leaves nothing
        try:
            hf_to_gguf(hf_dir, tmp, cfg.engine.target_type, locations=llamacpp_locations(cfg))
            tmp.replace(out)
        finally:
            tmp.unlink(missing_ok=True)
    return LlamaTarget(out, hf_dir, model_id)


class UpstreamFactory:
    """Starts llama-server for a head (or none), with the draft rule the cost rule picks."""

    def __init__(self, cfg: Config, target: LlamaTarget, *, binary: str | None = None) -> None:
        self.cfg, self.target = cfg, target
        if cfg.engine.flash_attn not in FLASH_ATTN:
            raise ConfigError(f"engine.flash_attn must be one of {', '.join(FLASH_ATTN)}, "
                              f"got {cfg.engine.flash_attn!r}")
        self.binary = find_llama_server(binary, llamacpp_locations(cfg))
        self.costs_dir = Path(cfg.models.cache_dir).expanduser() / "llama.cpp-costs"
        self._flash_attn: str | None = None if cfg.engine.flash_attn == "auto" else cfg.engine.flash_attn

    def launch(self, head: Path | None = None, spec: SpecParams = NO_HEAD) -> LaunchSpec:
        return self._launch(head, spec, self.flash_attn())

    def _launch(self, head: Path | None, spec: SpecParams, flash_attn: str) -> LaunchSpec:
        e = self.cfg.engine
        return LaunchSpec(binary=self.binary, model=self.target.gguf, head=head, spec=spec, threads=e.threads,
                          parallel=e.parallel, ctx_per_slot=e.ctx_per_slot, flash_attn=flash_attn,
                          log_dir=self.cfg.data_path / "logs")

    def flash_attn(self) -> str:
        """llama-server's -fa for every process started here: engine.flash_attn, or for "auto" what
        this machine measured faster for the target alone (once, cached beside the step costs; "" keeps
        llama.cpp's default)."""
        if self._flash_attn is None:
            e = self.cfg.engine
            key = cost_key(self.binary, self.target.gguf, e.threads, e.parallel, e.ctx_per_slot)
            context = max(16, min(FLASH_ATTN_CONTEXT, e.ctx_per_slot - 64))
            self._flash_attn = measure_flash_attn(lambda fa: self._launch(None, NO_HEAD, fa),
                                                  self.costs_dir / f"flash-attn-{key}.json", context=context,
                                                  start_timeout_s=e.start_timeout_s)
        return self._flash_attn

    def step_costs(self, head: Path) -> StepCosts:
        """This machine's step costs for the target with a head of `head`'s architecture (measured on
        llama-server once per binary, cached under models.cache_dir/llama.cpp-costs; the same for every
        version of a lineage, whose files differ only in values)."""
        e = self.cfg.engine
        key = cost_key(self.binary, self.target.gguf, f"head-bytes-{head.stat().st_size}", e.threads, e.parallel,
                       e.ctx_per_slot, f"fa-{self.flash_attn()}")
        cache = self.costs_dir / f"steps-{key}.json"
        return measure_step_costs(lambda spec: self.launch(head if spec.n_max else None, spec), cache,
                                  start_timeout_s=e.start_timeout_s)

    def rule(self, head: Path, acceptance: Sequence[float] | None, version: str) -> SpecParams:
        """The draft rule for `head` given its measured acceptance per position (None: no evidence).
        The step costs are measured even without evidence: the first version's load runs before
        serving starts, on a quiet machine, and every later version of its size reads the cache."""
        costs = self.step_costs(head)
        if not acceptance:
            log.warning("drafter %s has no measured acceptance yet: llama-server serves without it", version)
            return NO_HEAD
        spec, expected = choose_spec(acceptance, costs, margin=self.cfg.engine.min_speedup)
        per_pos = ", ".join(f"{a:.2f}" for a in acceptance[:4])
        steps = ", ".join(f"{costs.ratio(n):.2f}" for n in range(1, costs.max_n + 1))
        if spec.n_max == 0:
            log.warning("drafter %s does not pay on llama-server here (acceptance per position %s; a step drafting "
                        "1..%d tokens costs %s target steps): serving without it", version, per_pos, costs.max_n, steps)
        else:
            log.info("drafter %s on llama-server: n-max %d, p-min %.2f (acceptance per position %s; step costs %s; "
                     "expected %.2fx)", version, spec.n_max, spec.p_min, per_pos, steps, expected)
        return spec

    def start(self, version: str, head: Path | None, acceptance: Sequence[float] | None) -> Upstream:
        spec = self.rule(head, acceptance, version) if head is not None else NO_HEAD
        # the rule's head is remembered (RuleGuard) when the rule chose one
        rule = (head, spec) if head is not None and spec.n_max else None
        up = Upstream(self.launch(head if spec.n_max else None, spec), version=version, head_rule=rule)
        return up.start(self.cfg.engine.start_timeout_s)


class RuleGuard:
    """Do no harm, live: the rule a version was started with rests on its replay acceptance, measured
    on past traffic. Every `window` requests or `window_steps` decoding steps, whichever comes
    first (long answers give evidence in fewer requests), the serving upstream's own counts
    (llama-server's drafted / accepted) say what drafting gave; where that is under `floor` of the
    target alone, the version is restarted without its head (the same swap as a new version:
    start, health, route, drain), and every `reprobe` requests after that its rule is tried again."""

    WINDOW, WINDOW_STEPS, FLOOR, REPROBE = 24, 128, 1.0, 256

    def __init__(self, factory: UpstreamFactory, slot: DrafterSlot, *, window: int = WINDOW,
                 window_steps: int = WINDOW_STEPS, floor: float = FLOOR, reprobe: int = REPROBE) -> None:
        self.factory, self.slot = factory, slot
        self.window, self.window_steps, self.floor, self.reprobe = window, window_steps, floor, reprobe
        self.switches = 0
        self._lock = threading.Lock()
        # upstream -> [requests, tokens, steps, drafted]; weak: a stopped upstream's counts go with it
        self._counts: weakref.WeakKeyDictionary[Upstream, list[int]] = weakref.WeakKeyDictionary()
        self._busy = False

    @staticmethod
    def window_full(requests: int, steps: int, window: int = WINDOW, window_steps: int = WINDOW_STEPS) -> bool:
        """Whether a head's counts make a window: `window` requests or `window_steps` decoding
        steps, whichever comes first (bench/bench_llamacpp.py replays the same rule)."""
        return requests >= window or steps >= window_steps

    def observe(self, up: Upstream, stats: object) -> None:
        if up is not self.slot.get() or up.head_rule is None:
            return
        with self._lock:
            c = self._counts.setdefault(up, [0, 0, 0, 0])
            c[0] += 1
            c[1], c[2], c[3] = c[1] + stats.output_tokens, c[2] + stats.steps, c[3] + stats.drafted
            if up.launch.head is not None:
                due = self.window_full(c[0], c[2], self.window, self.window_steps)
            else:
                due = c[0] >= self.reprobe
            due = due and not self._busy
            if not due:
                return
            self._busy = True
            requests, tokens, steps, drafted = c
            self._counts.pop(up)
        threading.Thread(target=self._check, args=(up, requests, tokens, steps, drafted), name="livedraft-rule-guard",
                         daemon=True).start()

    def _check(self, up: Upstream, requests: int, tokens: int, steps: int, drafted: int) -> None:
        try:
            head, spec = up.head_rule
            if up.launch.head is not None:
                gain = served_speedup(tokens, steps, drafted, self.factory.step_costs(head), spec.n_max)
                if gain >= self.floor:
                    return
                log.warning("drafter %s on llama-server gave %.2fx the target alone over its last %d requests: "
                            "serving it without its head (its rule is tried again after %d requests)",
                            up.version, gain, requests, self.reprobe)
                new = Upstream(self.factory.launch(None, NO_HEAD), version=up.version, head_rule=up.head_rule)
            else:
                log.info("drafter %s on llama-server: trying its head again (n-max %d)", up.version, spec.n_max)
                new = Upstream(self.factory.launch(head, spec), version=up.version, head_rule=up.head_rule)
            new.start(self.factory.cfg.engine.start_timeout_s)
            if not self.slot.swap_if(up, new):  # a swap or rollback came first: it decides
                new.stop()
                return
            self.switches += 1
            up.retire()
        except Exception:
            log.exception("the draft rule's live check of drafter %s failed", up.version)
        finally:
            with self._lock:
                self._busy = False


class GgufHeadSource:
    """runtime.hotswap.DrafterSource for llama-server: the registry's champion as a started
    upstream. `load` downloads the version, writes its head GGUF (once), chooses its draft rule
    from the version's replay acceptance and starts llama-server with it."""

    def __init__(self, registry_source: object, factory: UpstreamFactory) -> None:
        self.inner = registry_source  # online.registry.source.RegistryDrafterSource
        self.factory = factory

    def current(self) -> DrafterRef | None:
        return self.inner.current()

    def load(self, ref: DrafterRef) -> Upstream:
        try:
            version = int(ref.version)
        except ValueError:
            raise LivedraftError(f"{ref.version!r} is not a registry version") from None
        registry = self.inner.registry
        t0 = time.perf_counter()
        path = registry.download(version)
        head = head_gguf(path, self.factory.target)
        up = self.factory.start(ref.version, head, registry.acceptance_per_position(version))
        self.inner.prune()
        self._log(version, {"llama_server_swap_load_seconds": time.perf_counter() - t0,
                            "llama_server_spec_n_max": up.launch.spec.n_max,
                            "llama_server_spec_p_min": up.launch.spec.p_min})
        return up

    def retire(self, up: Upstream) -> None:
        """HotSwapper's on_retire: drain and stop `up`, then record what it served."""
        up.retire()
        if up.version.isdigit():
            self._log(int(up.version), {"llama_server_requests_served": up.served})

    def report_rollback(self, ref: DrafterRef, reason: str, numbers: dict[str, float]) -> bool | None:
        return self.inner.report_rollback(ref, reason, numbers)

    def _log(self, version: int, metrics: dict[str, float]) -> None:
        try:
            self.inner.registry.log_serving(version, metrics)
        except Exception:  # the registry being away must not stop a swap
            log.exception("could not log llama-server facts to version %d's run", version)


def head_gguf(drafter_dir: Path, target: LlamaTarget) -> Path | None:
    """The eagle head at `drafter_dir` as llama.cpp's GGUF (written once beside it); None for a drafter
    that is not an EAGLE-3 head (llama-server then serves without one)."""
    from runtime.drafters.eagle import is_eagle_dir
    from runtime.drafters.eagle_gguf import export_gguf

    if not is_eagle_dir(drafter_dir):
        log.warning("%s is not an EAGLE-3 head: llama-server serves without a drafter", drafter_dir)
        return None
    out = drafter_dir.parent / f"{drafter_dir.name}.head.gguf"
    if not out.is_file():  # export_gguf writes atomically: a file there is whole
        export_gguf(drafter_dir, out, target=str(target.gguf))  # the tokenizer exactly as llama-server reads it
    return out


@dataclass
class LlamaServing:
    """What `start_llama_serving` started; `stop` drains, then stops every llama-server."""

    server: CompletionServer
    worker: LlamaServerWorker
    swapper: HotSwapper | None
    slot: DrafterSlot
    sink: object | None
    guard: RuleGuard

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self, timeout_s: float = 30.0) -> bool:
        drained = self.server.stop(timeout_s)
        if self.swapper is not None:
            self.swapper.stop(timeout_s)
            prev = self.swapper.previous
            if prev is not None:
                prev.stop()
        self.slot.get().stop()
        self.worker.stop_upstreams()
        if self.sink is not None:
            self.sink.flush(timeout_s)
        return drained


def start_llama_serving(cfg: Config, *, target: LlamaTarget, tokenizer: object, factory: UpstreamFactory,
                        source: DrafterSource | None = None, initial: Upstream | None = None,
                        sink: object | None = None, host: str | None = None, port: int | None = None,
                        dead_letters: Callable[[], int] | None = None, vocab_size: int | None = None) -> LlamaServing:
    """Starts the HTTP server in front of llama-server and returns once both serve. Without
    `initial`, the source's current version is started (else the target alone)."""
    from online.serving.engine import ServeError, server_options

    s = cfg.serve
    initial_ref = None
    if initial is None and source is not None and (initial_ref := source.current()) is not None:
        initial = source.load(initial_ref)
    if initial is None:
        initial = factory.start("none", None, None)
    slot = DrafterSlot(initial)  # holds Upstreams: a swap routes new requests to another process
    swapper = None
    if source is not None:
        retire = source.retire if isinstance(source, GgufHeadSource) else Upstream.retire
        swapper = HotSwapper(slot, source, poll_s=s.poll_s, initial=initial_ref, on_retire=retire,
                             judge_undrafted=False,
                             rollback=s.rollback())
    options = server_options(cfg, host, port)
    worker = LlamaServerWorker(slot, job_queue(options), target_model=target.model_id, sink=sink,
                               max_batch=cfg.engine.parallel, request_timeout_s=options.request_timeout_s,
                               wait_s=cfg.engine.wait_s, vocab_size=vocab_size,
                               baseline=lambda: factory.start("none", None, None),
                               max_context=cfg.engine.ctx_per_slot, start_timeout_s=cfg.engine.start_timeout_s)
    try:
        server = CompletionServer(worker, tokenizer, model_id=target.model_id, options=options, swapper=swapper,
                                  sink=sink, dead_letters=dead_letters)
    except OSError as e:
        initial.stop()
        raise ServeError(f"cannot listen on {options.host}:{options.port}: {e.strerror or e}: "
                         "pick another --port (0 = any free port)") from e
    guard = RuleGuard(factory, slot)
    worker.on_served = guard.observe
    server.start()
    if swapper is not None:
        swapper.start()
    return LlamaServing(server, worker, swapper, slot, sink, guard)


__all__ = ["GgufHeadSource", "LlamaServing", "LlamaTarget", "UpstreamError", "UpstreamFactory",
           "resolve_llama_target", "start_llama_serving"]
