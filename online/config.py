"""The one place configuration is read: a TOML file plus LIVEDRAFT_* environment variables.

Sections are typed dataclasses with defaults. An environment variable
`LIVEDRAFT_<SECTION>__<FIELD>` (double underscore) overrides `[section] field`
in the file; `LIVEDRAFT_CONFIG` names the file; `LIVEDRAFT_API_KEY` sets `[serve] api_key`;
`LIVEDRAFT_DATA_DIR` sets `data_dir` and `LIVEDRAFT_LLAMA_SERVER` sets `llama_server` (top-level
keys). Unknown keys are errors, so a typo never silently does nothing; `LIVEDRAFT_NATIVE_KERNELS`
and `LIVEDRAFT_KERNEL_DIR` are the runtime's own switches (runtime/native.py), not config.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.hotswap import RollbackConfig

ENV_PREFIX = "LIVEDRAFT_"
# Read by the runtime itself in every process that runs a model (runtime/native.py), not config keys.
RUNTIME_ENV = frozenset({"LIVEDRAFT_NATIVE_KERNELS", "LIVEDRAFT_KERNEL_DIR"})


class ConfigError(ValueError):
    """Bad configuration: the message says which key and what is expected."""


@dataclass
class StoreConfig:
    # Empty means sqlite:///<data_dir>/livedraft.db
    url: str = ""


@dataclass
class StreamConfig:
    kind: str = "sql"  # "sql" (embedded, the default), "kafka" or "memory"
    topic: str = "livedraft.traces"  # Kafka topic / embedded-stream name of the trace events
    bootstrap_servers: str = "127.0.0.1:9092"  # Kafka brokers, comma-separated
    partitions: int = 4  # partitions of the Kafka topic (keyed by request id), created if missing
    consumer_group: str = "livedraft-collector"  # the collector's consumer group
    queue_size: int = 10000  # bounded emit queue in the runtime; overflow is dropped and counted
    linger_ms: int = 20  # Kafka producer linger
    batch_size: int = 262144  # Kafka producer batch bytes
    batch_max_records: int = 500  # records per poll (collector, cache maintainer)
    kafka_compression: str = ""  # "", "gzip" (lz4/zstd/snappy need their libraries); "" is fastest on localhost
    kafka_session_timeout_ms: int = 6000  # consumer group liveness (Kafka's default floor is 6000)
    kafka_heartbeat_interval_ms: int = 1000  # Kafka consumer heartbeat
    sql_url: str = ""  # embedded stream (kind "sql"): its database; empty = the store's URL
    sql_poll_interval_s: float = 0.05  # embedded stream: how often an idle consumer re-reads the log
    # embedded stream: the daemon prunes records older than this that every consumer group has
    # committed past (the store keeps the traces); 0 = keep forever
    sql_retention_hours: float = 168.0


@dataclass
class ModelsConfig:
    cache_dir: str = "~/.cache/livedraft/models"  # GGUF files are converted to safetensors here
    # cpu, cuda, cuda:N or auto (CUDA when available): the target's, and a model drafter's training rounds' in
    # a daemon without a target (with one they train on the target's device)
    device: str = "auto"
    dtype: str = "auto"  # auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16


MIXED_PRECISION = ("no", "bf16")  # TrainerConfig.mixed_precision: fp32, or bfloat16 matmuls under autocast
LINEAGES = ("champion", "trainee")  # TrainerConfig.lineage


@dataclass
class TrainerConfig:
    """Online distillation (online/trainer) and its promotion gate."""

    loss: str = "fkl"  # soft-label divergence: fkl, rkl, jsd, tvd (online/trainer/losses.py)
    lr: float = 1e-3  # learning rate (AdamW)
    steps: int = 60  # optimizer steps; training stops at steps or max_seconds, whichever first
    max_seconds: float = 0.0  # wall-clock budget; 0 = none
    batch_size: int = 8  # traces per step (padded batch)
    ce_weight: float = 0.5  # cross-entropy on the target's tokens at every output position
    jsd_beta: float = 0.5  # only for loss = "jsd"
    seed: int = 0  # training is deterministic in this seed
    max_grad_norm: float = 1.0  # gradient clipping
    weight_decay: float = 0.0  # AdamW weight decay
    lora: bool = False  # train a LoRA adapter (merged before saving) instead of all weights
    lora_r: int = 8  # LoRA rank (model drafters, lora = true)
    lora_alpha: int = 16  # LoRA alpha
    lora_dropout: float = 0.0  # LoRA dropout
    lora_target_modules: str = "q_proj,k_proj,v_proj,o_proj"  # comma-separated module names
    # -- eagle (EAGLE-3 feature drafter) rounds --
    ttt_steps: int = 3  # training-time test: the head unrolled on its own outputs this many steps
    ttt_decay: float = 1.0  # step j of the unrolled loss weighs ttt_decay ** j
    prompt_weight: float = 0.0  # weight of prompt positions (output weigh 1); 0: logits on output rows only
    rejected_weight: float = 1.0  # extra weight where the served draft was rejected (OSD)
    warmup_steps: int = 10  # linear learning-rate warm-up, then cosine decay to 10 %
    draft_vocab: int = 8192  # draft vocabulary of a new head: the log's most frequent target tokens
    # a round admits output tokens seen this often in its window into the draft vocabulary; 0 = fixed
    vocab_refresh: int = 1
    mixed_precision: str = "no"  # eagle heads: "bf16" runs the head's matmuls in bfloat16 (fp32 weights and loss)
    # -- crossvocab (OmniDraft hybrid distillation) --
    ngram_weight: float = 1.0  # extra cross-entropy weight where several drafter tokens spell one target token
    promote_margin: float = 0.05  # candidate must beat the champion's held-out mean acceptance length by this
    # what a round trains from: "champion", or "trainee": the last round's candidate, promoted or not, unless its
    # held-out mean acceptance length fell below the champion's by more than promote_margin (the gate still decides
    # what serves; a promotion or rollback by hand starts again from the champion)
    lineage: str = "trainee"
    # eagle, lineage "trainee": a round resumes its parent's AdamW state (optimizer.pt beside the candidate, kept out
    # of the registry) and learning rate: warm-up over the lineage's first warmup_steps, then a constant lr, one
    # continuous run gated every round; false: each round a fresh optimizer with its own warm-up and cosine decay
    carry_optimizer: bool = True
    # catch-up rounds: a round trains catch_up_steps instead of steps (0 = never) when the drafter is behind its
    # traffic: the last round's candidate was promoted, or the newest quarter of the window was served at under
    # catch_up_ratio of the acceptance rate of the window's older traces (a shift; online.trainer.round.catch_up).
    # 64 with shift_answers 2 recovered from the second traffic's shift in 98 requests (either alone in over 140)
    # and from the first's in 69 (the defaults 94), at 2.2x the rounds' training steps (docs/benchmarks.md,
    # "Online adaptation"); off by default, for a CPU the trainer shares with serving
    catch_up_steps: int = 0
    catch_up_ratio: float = 0.6  # the served acceptance ratio, newest quarter to the rest, that means a shift
    # true: a round that trains on answers sampled after a shift (shift_answers) is a catch-up round too, not only
    # the round on the shift and those after a promotion (needs catch_up_steps and shift_answers to do anything)
    catch_up_answers: bool = False
    # from a shift on (as above, whatever catch_up_steps is), the target answers the prompts of the next
    # shift_prompts requests (the newest of the quarter that showed it, then each round's new ones) shift_answers more
    # times each, sampled at shift_temperature, and rounds train on those answers beside their traces while the
    # traces stay in the window: data for the new traffic without a user request more; a shift counts again once
    # the traces from before it have left the window. For eagle heads (the answers carry no soft labels: a model
    # drafter learns only their tokens). 0 = off; online.trainer.round.ShiftAnswers
    shift_answers: int = 0
    shift_prompts: int = 96  # prompts answered again per shift (at most shift_prompts * shift_answers answers)
    shift_temperature: float = 0.8  # the temperature those answers are sampled at
    replay_k: int = 4  # draft length the replay gate scores with (match serving)
    # eagle: memory for the target's passes over the last round's newest traces, which the next round's window
    # reads again instead of running the target over them (~0.9 MB per 100-token SmolLM2 trace); 0 = off
    feature_cache_mb: int = 256
    holdout_fraction: float = 0.2  # newest share of a window held out for the gate

    @property
    def lora_modules(self) -> list[str]:
        return [m.strip() for m in self.lora_target_modules.split(",") if m.strip()]


@dataclass
class RegistryConfig:
    """MLflow tracking + model registry (online/registry/versions.py)."""

    tracking_uri: str = ""  # empty: sqlite:///<data_dir>/mlflow.db (never the project's own DB)
    registry_uri: str = ""  # empty: the tracking URI
    artifact_root: str = ""  # empty: <data_dir>/mlartifacts
    experiment: str = "livedraft-trainer"  # MLflow experiment holding the rounds
    model_name: str = "livedraft-drafter"  # registered model holding the drafter versions
    cache_dir: str = ""  # empty: <data_dir>/drafters (downloaded registry versions)
    keep_cached: int = 4  # downloaded versions kept beyond those an alias names (0: keep every one)
    ui_host: str = "127.0.0.1"  # `livedraft ui` bind address
    ui_port: int = 5000  # `livedraft ui` port


@dataclass
class CacheConfig:
    """Model-free drafting caches (suffix tree / n-gram), maintained from the stream (online/cache/)."""

    kind: str = "suffix"  # "suffix" (SuffixDecoding trees) or "ngram" (n-gram table)
    max_sequences: int = 10000  # cached finished outputs, FIFO eviction of whole sequences
    max_tokens: int = 0  # bound on their total tokens as well (0 = none)
    max_depth: int = 24  # suffix: max match + draft length (and tree depth)
    max_spec_factor: float = 1.0  # suffix: a match of m tokens drafts at most factor*m + offset
    max_spec_offset: float = 0.0  # suffix: see max_spec_factor
    min_token_prob: float = 0.1  # stop drafting once the path probability falls below this
    ngram_max_n: int = 3  # ngram: longest context
    # crossvocab: a drafter directory (its tokenizer) whose vocabulary bridge (OmniDraft's n-gram
    # cache) the daemon also maintains from the stream and `serve --drafter-kind crossvocab` tails
    bridge_drafter: str = ""
    # one cache per trace tag (tenant): no draft of one tenant's request comes from another's outputs
    # (speculation patterns are a side channel, arXiv 2411.01076); false shares one cache: an explicit opt-in
    tag_scoped: bool = True
    include_prompt: bool = False  # cache prompt + output (default: outputs only, as SuffixDecoding)
    consumer_group: str = "livedraft-cache"  # the maintainer's consumer group
    snapshot_every_s: float = 60.0  # maintainer: snapshot at most this often when there is news ...
    snapshot_every_n: int = 1000  # ... or after this many applied traces, whichever comes first
    keep_snapshots: int = 3  # older snapshots are deleted (a corrupt newest falls back to these)
    hybrid_threshold: float = 1.0  # hybrid drafter: suffix draft when its score >= this, else the model


@dataclass
class ServeConfig:
    """`livedraft serve`: the HTTP API in front of the engine, and drafter hot-swap."""

    host: str = "127.0.0.1"  # listen address
    port: int = 8000  # listen port (0 = any free port)
    max_batch: int = 8  # requests decoded together (continuous batching); 8 suits a 2-core CPU
    reuse_prefix: bool = True  # a request keeps the KV of the prompt prefix it shares with a free row's last request
    max_queue: int = 64  # requests waiting for the engine, all clients; beyond: 503
    max_queue_per_client: int = 16  # per client (API key tenant, else address); beyond: 429
    max_body_bytes: int = 1048576  # larger request bodies: 413
    max_header_bytes: int = 16384  # larger request line + headers: 431
    default_max_tokens: int = 64  # when a request gives no max_tokens
    request_timeout_s: float = 300.0  # a request not finished by then: 504
    read_timeout_s: float = 10.0  # a request body that stops arriving for this long: 408
    header_timeout_s: float = 10.0  # request headers that do not complete within this: connection closed
    keep_alive_s: float = 5.0  # idle keep-alive connections are closed after this
    api_key: str = ""  # clients must send `Authorization: Bearer <key>` on /v1 (env LIVEDRAFT_API_KEY)
    api_keys_file: str = ""  # JSON or TOML {"key": "tenant"}: each key's requests carry its tenant's tag
    protect_metrics: bool = False  # with API keys, /metrics and /healthz need a key too
    trust_client_id: bool = False  # queue fairness by the X-Client-Id header (only behind a trusted proxy)
    durable_traces: bool = False  # answer only once the request's trace is flushed to the stream
    drain_timeout_s: float = 30.0  # on SIGTERM: finish queued requests for this long
    k: int = 4  # draft length (fixed mode, adaptive = false)
    adaptive: bool = True  # k per step for the most expected tokens/s, 0 (no drafting) to k_max
    k_max: int = 8  # upper bound on k in adaptive mode
    torch_threads: int = 0  # torch intra-op threads; 0 = torch's default (set 1 on a busy small machine)
    watch_registry: bool = False  # hot-swap the registry's champion
    poll_s: float = 5.0  # how often the champion alias is polled
    rollback_window: int = 20  # requests per version in the rolling acceptance window
    rollback_min_requests: int = 8  # the new version is judged once it has served this many
    rollback_max_drop: float = 0.5  # roll back when the new version keeps < (1 - this) of the old gain ...
    rollback_z: float = 2.0  # ... by more than this many standard errors (the requests' spread in both windows)

    def rollback(self) -> RollbackConfig:
        """The hot-swapper's rollback rule (ConfigError on values it cannot use)."""
        from runtime.hotswap import RollbackConfig

        try:
            return RollbackConfig(window=self.rollback_window, min_requests=self.rollback_min_requests,
                                  max_drop=self.rollback_max_drop, z=self.rollback_z)
        except ValueError as e:
            raise ConfigError(f"[serve] {e}") from None


ENGINES = ("livedraft", "llama-server")  # EngineConfig.kind
FLASH_ATTN = ("auto", "on", "off")  # EngineConfig.flash_attn


@dataclass
class EngineConfig:
    """The serving engine behind `serve` / `up`: livedraft's own, or a llama-server it supervises."""

    kind: str = "livedraft"  # "livedraft" or "llama-server" (its binary: the top-level llama_server)
    threads: int = 0  # llama-server's -t / -tb; 0 = llama.cpp's default
    parallel: int = 4  # llama-server's slots (requests decoded together)
    ctx_per_slot: int = 2048  # context per slot (prompt + completion)
    target_type: str = "f32"  # the GGUF written from a Hugging Face target directory (f32, f16, bf16, q8_0)
    # llama-server's flash attention: on, off, or auto: off where this machine measured the target alone faster
    # with it off at a 512-token context (once, cached; on CPUs its kernel can cost more than it saves,
    # docs/benchmarks.md), else llama.cpp's default
    flash_attn: str = "auto"
    start_timeout_s: float = 120.0  # a llama-server not healthy by then failed to start
    wait_s: float = 30.0  # a request waits this long for a restarting llama-server, then 503
    min_speedup: float = 1.05  # a head is served only when the cost rule expects at least this speed-up


@dataclass
class DaemonConfig:
    """`livedraft daemon`: collector, trainer schedule and cache maintainer in one process."""

    interval_s: float = 600.0  # a round at least this often while new traces arrive; 0 = off
    # a round as soon as this many traces arrived since the last; 0 = off. 16 (window_traces 64, holdout_traces 13,
    # trainer.steps 16) recovers from a traffic shift in 68-116 requests, and in 141 on a second traffic with one
    # request in eight held out (docs/benchmarks.md, "Online adaptation"), at a registered version per round
    min_new_traces: int = 200
    check_interval_s: float = 5.0  # how often the new-traces trigger counts (one cheap query)
    window_traces: int = 1000  # newest traces a round reads (train + held out)
    holdout_traces: int = 100  # how many of those are held out for the promotion gate
    # which: "stable", one request in every window_traces / holdout_traces by a hash of its id, held out for life, so
    # a round also trains on the newest traffic (after a shift: +0.08 mean acceptance length over the first 50
    # requests, docs/benchmarks.md); "newest", the newest holdout_traces, which no round trains on before the next
    holdout: str = "stable"
    tag: str = ""  # train only on traffic with this domain/tenant tag; empty = all
    retry_backoff_s: float = 30.0  # after a failed round, doubling up to interval_s while failures repeat
    drain_timeout_s: float = 60.0  # on SIGTERM, wait this long for a running round before abandoning it
    collector_poll_s: float = 1.0  # stream poll timeout of the collector loop
    work_dir: str = ""  # empty: <data_dir>/trainer (candidates before they are registered)
    cache: bool = True  # run the suffix/n-gram cache maintainer ([cache]) in the daemon


@dataclass
class Config:
    data_dir: str = "~/.livedraft"  # everything local lives here (env LIVEDRAFT_DATA_DIR)
    # llama.cpp's llama-server (a file, a directory holding it, or a name on PATH; env LIVEDRAFT_LLAMA_SERVER);
    # empty: the one `livedraft engine install llama-server` built under models.cache_dir, then PATH
    llama_server: str = ""
    models: ModelsConfig = field(default_factory=ModelsConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    daemon: DaemonConfig = field(default_factory=DaemonConfig)

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir).expanduser()

    def store_url(self) -> str:
        return self.store.url or f"sqlite:///{self.data_path / 'livedraft.db'}"

    def stream_sql_url(self) -> str:
        """The embedded stream's database: stream.sql_url, else the store's."""
        return self.stream.sql_url or self.store_url()


def load_config(path: str | os.PathLike | None = None, env: dict[str, str] | None = None) -> Config:
    """File (explicit path, else $LIVEDRAFT_CONFIG, else none) then environment overrides."""
    env = dict(os.environ) if env is None else env
    path = path or env.get(ENV_PREFIX + "CONFIG")
    if ENV_PREFIX + "API_KEY" in env:  # vLLM's VLLM_API_KEY convention, for [serve] api_key
        env = {("LIVEDRAFT_SERVE__API_KEY" if k == ENV_PREFIX + "API_KEY" else k): v for k, v in env.items()}
    raw: dict[str, Any] = {}
    if path:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from e
    cfg = _build(Config, raw, "")
    _apply_env(cfg, env)
    return cfg


def as_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def to_toml(cfg: Config) -> str:
    """The effective config as TOML (what `livedraft config show` prints)."""
    top, sections = [], []
    for k, v in as_dict(cfg).items():
        if isinstance(v, dict):
            sections.append(f"\n[{k}]")
            sections += [f"{kk} = {_toml_value(vv)}" for kk, vv in v.items()]
        else:
            top.append(f"{k} = {_toml_value(v)}")
    return "\n".join(top + sections) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _build(cls: type, raw: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(raw) - names
    if unknown:
        raise ConfigError(f"unknown config key(s) {sorted(unknown)} in [{where or 'top level'}]; "
                          f"known: {sorted(names)}")
    kwargs = {}
    for name, value in raw.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"[{name}] must be a table")
            kwargs[name] = _build(hint, value, name)
        else:
            kwargs[name] = _coerce(value, hint, f"{where}.{name}" if where else name)
    return cls(**kwargs)


def _coerce(value: Any, hint: Any, key: str) -> Any:
    base = _base_type(hint)
    if isinstance(value, str) and base is not str:
        return _parse_str(value, base, key)
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base is not None and not isinstance(value, base):
        raise ConfigError(f"config key {key} must be {base.__name__}, got {value!r}")
    return value


def _base_type(hint: Any) -> type | None:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args:  # Optional[X] / X | None
        return _base_type(args[0])
    return typing.get_origin(hint) or (hint if isinstance(hint, type) else None)


def _parse_str(value: str, base: type | None, key: str) -> Any:
    try:
        if base is bool:
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if base is int:
            return int(value)
        if base is float:
            return float(value)
        if base is list:
            return [v.strip() for v in value.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"config key {key} must be {base.__name__}, got {value!r}") from None
    return value


def _apply_env(cfg: Config, env: dict[str, str]) -> None:
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name == ENV_PREFIX + "CONFIG":
            continue
        if name.startswith(ENV_PREFIX + "TEST_") or name in RUNTIME_ENV:
            continue  # test-suite knobs and the runtime's process-wide switches, not config
        path = name[len(ENV_PREFIX):].lower().split("__")
        target: Any = cfg
        for part in path[:-1]:
            if not hasattr(target, part) or not dataclasses.is_dataclass(getattr(target, part)):
                raise ConfigError(f"environment variable {name}: no config section {part!r}")
            target = getattr(target, part)
        leaf = path[-1]
        if not dataclasses.is_dataclass(target) or leaf not in {f.name for f in dataclasses.fields(target)}:
            raise ConfigError(f"environment variable {name}: no config key {'.'.join(path)}")
        hint = typing.get_type_hints(type(target))[leaf]
        setattr(target, leaf, _coerce(value, hint, ".".join(path)))
