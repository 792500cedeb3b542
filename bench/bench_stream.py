"""Traffic-log throughput: runtime sink → stream → collector → SQLite store, end to end.

For each transport (kafka over a tansu broker started here, and the embedded sql stream)
the benchmark process plays the runtime: it emits N synthetic 256-token traces (64-token
prompts, 4-token drafts, top-8 soft labels at every rejection, ~6.7 KB of msgpack each)
through the transport's sink as fast as `emit` accepts them. The collector runs as its own
process (`python -m online.collector`, as deployed) and writes into a fresh SQLite store.
A warm-up batch is collected first, so start-up and the Kafka group join are not timed.

Reported per transport: end-to-end traces/s (first emit → last trace committed in the
store), the emitter's rate (emit + flush until acknowledged), drops, and the store count.

    python bench/bench_stream.py --traces 20000 --transports kafka,sql
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from devkit.kafka_broker import KafkaBroker  # noqa: E402
from devkit.stream_helpers import start_collector, store_count, write_config  # noqa: E402
from devkit.synthetic import synthetic_trace  # noqa: E402
from online.store import Store  # noqa: E402


def make_traces(n: int, seed: int) -> list:
    rng = random.Random(seed)
    return [synthetic_trace(rng, prompt_len=64, output_len=256, tag=rng.choice(["chat", "code", None]))
            for _ in range(n)]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_count(engine: sa.Engine, n: int, timeout_s: float, procs: list[subprocess.Popen]) -> float:
    """Blocks until the store holds >= n traces; returns the monotonic time it saw them."""
    deadline = time.monotonic() + timeout_s
    while store_count(engine) < n:
        for proc in procs:
            if proc.poll() is not None:
                raise SystemExit(f"collector died (rc {proc.returncode}): {proc.stderr.read()[-2000:]}")
        if time.monotonic() > deadline:
            raise SystemExit(f"store has {store_count(engine)} of {n} traces after {timeout_s}s")
        time.sleep(0.02)
    return time.monotonic()


def open_sink(cfg_path: Path, queue_size: int):
    from online.config import load_config
    from online.stream import open_sink

    cfg = load_config(cfg_path, env={})
    cfg.stream.queue_size = queue_size  # hold the whole burst: this measures throughput, not drop policy
    return open_sink(cfg)


def run_one(kind: str, traces: list, warmup: list, work: Path, batch: int, broker: KafkaBroker | None,
            collectors: int) -> dict:
    store_url = f"sqlite:///{work / f'{kind}-store.db'}"
    stream: dict[str, object] = {"kind": kind, "batch_max_records": batch, "consumer_group": "bench"}
    if kind == "kafka":
        stream.update(bootstrap_servers=broker.bootstrap, topic=f"bench-{int(time.time() * 1000)}", partitions=4)
    else:
        stream.update(sql_url=f"sqlite:///{work / 'sql-stream.db'}", sql_poll_interval_s=0.02)
    cfg_path = write_config(work / f"{kind}.toml", store_url=store_url, stream=stream, data_dir=work)
    sink = open_sink(cfg_path, len(traces) + len(warmup))
    # Kafka scales the collector with consumer-group members (one per partition at most);
    # the embedded stream runs one collector per group.
    n_proc = collectors if kind == "kafka" else 1
    Store.open(store_url).close()  # migrate once, before several collectors race to
    procs = [start_collector(cfg_path, "--batch", str(batch), "--log-every", "5") for _ in range(n_proc)]
    engine = sa.create_engine(store_url)
    try:
        for t in warmup:
            sink.emit(t)
        sink.flush(60)
        wait_count(engine, len(warmup), 120, procs)
        if n_proc > 1:  # let the group settle on all members before timing (a rebalance pauses consumption)
            time.sleep(4.0)

        pids = [p.pid for p in procs] + ([broker.proc.pid] if kind == "kafka" else [])
        cpu0 = [cpu_s(pid) for pid in pids]
        emitter_cpu0 = time.process_time()
        t0 = time.monotonic()
        for t in traces:
            sink.emit(t)
        t_emit = time.monotonic()
        sink.flush(300)
        t_flushed = time.monotonic()
        t_end = wait_count(engine, len(warmup) + len(traces), 600, procs)
        stored = store_count(engine)
        emitter_cpu = time.process_time() - emitter_cpu0  # includes this process's store polling
        cpu = [cpu_s(pid) - c for pid, c in zip(pids, cpu0, strict=True)]
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        sink.close(10)
        engine.dispose()
    n = len(traces)
    return {
        "transport": kind, "collectors": n_proc, "traces": n, "batch": batch,
        "end_to_end_traces_per_s": round(n / (t_end - t0), 1),
        "emit_call_us": round((t_emit - t0) / n * 1e6, 2),
        "emitter_traces_per_s": round(n / (t_flushed - t0), 1),
        "seconds": round(t_end - t0, 2),
        "dropped": sink.dropped, "failed": sink.failed,
        # CPU per trace by stage, and the rate this CPU cost allows on 2 otherwise idle cores
        # (whatever else the machine ran during the measurement): all stages share 2 cores, and
        # each Python process (GIL) gets at most one.
        "cpu_ms_per_trace": {"emitter": round(emitter_cpu / n * 1e3, 3),
                             "collectors": round(sum(cpu[:n_proc]) / n * 1e3, 3),
                             "broker": round(sum(cpu[n_proc:]) / n * 1e3, 3)},
        "cpu_bound_traces_per_s_2_cores": round(min(2 / ((emitter_cpu + sum(cpu)) / n),
                                                    1 / (emitter_cpu / n),
                                                    1 / (max(cpu[:n_proc]) / n)), 1),
        "stored": stored - len(warmup),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", type=int, default=20000)
    ap.add_argument("--transports", default="kafka,sql")
    ap.add_argument("--batch", type=int, default=500, help="collector batch (stream.batch_max_records)")
    ap.add_argument("--collectors", type=int, default=1, help="collector processes in the Kafka consumer group")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/stream.json")
    args = ap.parse_args()
    kinds = [k.strip() for k in args.transports.split(",") if k.strip()]

    t = time.perf_counter()
    traces = make_traces(args.traces, args.seed)
    warmup = make_traces(200, args.seed + 1)
    print(f"generated {len(traces)} traces in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    rows = []
    broker = KafkaBroker().start() if "kafka" in kinds else None
    try:
        with tempfile.TemporaryDirectory(prefix="bench-stream-") as tmp:
            for kind in kinds:
                rows.append(run_one(kind, traces, warmup, Path(tmp), args.batch, broker, args.collectors))
                print(f"{kind}: {rows[-1]}", file=sys.stderr)
    finally:
        if broker is not None:
            broker.stop()

    from online.stream.events import encode_trace

    meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "payload_bytes_mean": round(sum(len(encode_trace(t)) for t in traces[:500]) / min(500, len(traces)))}
    header = ["transport", "collectors", "traces", "end-to-end traces/s", "emitter traces/s", "emit() µs",
              "CPU ms/trace (emitter / collector / broker)", "CPU-bound traces/s on 2 cores", "dropped", "stored"]
    print(f"\n{args.traces} traces of 256 output tokens (~{meta['payload_bytes_mean']} B each), collector batch "
          f"{args.batch}, {meta['cpus']} CPUs, load {meta['load_avg_1m']}\n")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for r in rows:
        c = r["cpu_ms_per_trace"]
        print(f"| {r['transport']} | {r['collectors']} | {r['traces']} | {r['end_to_end_traces_per_s']:.0f} | "
              f"{r['emitter_traces_per_s']:.0f} | {r['emit_call_us']:.1f} | "
              f"{c['emitter']:.2f} / {c['collectors']:.2f} / "
              f"{c['broker']:.2f} | {r['cpu_bound_traces_per_s_2_cores']:.0f} | {r['dropped']} | {r['stored']} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
