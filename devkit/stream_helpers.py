"""Reusable collector crash test: run `python -m online.collector` as a subprocess, SIGKILL it
mid-stream, restart it, and check that every event is in the store exactly once.

Transport-agnostic: the config file picks the stream (sql here; tests/test_stream_contract.py
or the Kafka tests pass a kafka config). The stream must already hold the events.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import sqlalchemy as sa

ROOT = Path(__file__).resolve().parents[1]


def write_config(path: Path, *, store_url: str, stream: dict[str, object], data_dir: Path | None = None) -> Path:
    """A TOML config with [store] url and the given [stream] keys (str/int/float/bool values)."""

    def val(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        return repr(v) if isinstance(v, int | float) else json.dumps(str(v))

    lines = [f"data_dir = {val(data_dir or path.parent)}", "[store]", f"url = {val(store_url)}", "[stream]"]
    lines += [f"{k} = {val(v)}" for k, v in stream.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def start_collector(config: Path, *args: str) -> subprocess.Popen:
    """`python -m online.collector --config CONFIG ARGS` from the repo root (stdout/stderr piped)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIVEDRAFT_") or k.startswith("LIVEDRAFT_TEST_")}
    return subprocess.Popen([sys.executable, "-m", "online.collector", "--config", str(config), *args],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def stored_event_ids(store_url: str) -> list[str]:
    engine = sa.create_engine(store_url)
    try:
        with engine.connect() as conn:
            return list(conn.execute(sa.text("SELECT event_id FROM traces ORDER BY id")).scalars())
    finally:
        engine.dispose()


def store_count(engine: sa.Engine) -> int:
    """Traces in the store (0 before it is migrated)."""
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM traces")).scalar_one())
    except sa.exc.OperationalError:  # (sqlite) table not created yet / PG: relation missing
        return 0
    except sa.exc.ProgrammingError:
        return 0


def wait_for_count(store_url: str, n: int, timeout_s: float, proc: subprocess.Popen | None = None) -> int:
    """Polls the store until it holds >= n traces; returns the count (raises on timeout or if proc died)."""
    engine = sa.create_engine(store_url)
    deadline = time.monotonic() + timeout_s
    try:
        while (c := store_count(engine)) < n:
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"collector exited early (rc {proc.returncode}): {proc.stderr.read()[-2000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"store holds {c} traces after {timeout_s}s, expected >= {n}")
            time.sleep(0.005)
        return c
    finally:
        engine.dispose()


def collector_kill_restart(config: Path, store_url: str, expected_event_ids: Iterable[str], *,
                           kill_after: int | Sequence[int], batch: int = 50, timeout_s: float = 60.0,
                           seed: int = 0) -> dict[str, object]:
    """Runs the collector and SIGKILLs it once the store holds each `kill_after` count of traces
    (plus a random 0-40 ms, so the kill lands anywhere in a batch, not just after a commit);
    restarts it each time; after the last restart waits until every expected event is stored,
    stops it with SIGTERM, and asserts each expected event_id is stored exactly once and
    nothing else is. Returns {"kills": [(count at kill, count after death)], "restart": the
    last run's final stats}."""
    expected = set(expected_event_ids)
    rng = random.Random(seed)
    kills = []
    for n in [kill_after] if isinstance(kill_after, int) else kill_after:
        proc = start_collector(config, "--batch", str(batch), "--log-every", "1")
        try:
            at_kill = wait_for_count(store_url, n, timeout_s, proc)
            time.sleep(rng.uniform(0, 0.04))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        kills.append((at_kill, len(stored_event_ids(store_url))))
        assert kills[-1][1] < len(expected), (
            f"the collector had stored everything ({kills[-1][1]}) before the kill: lower kill_after or add events")
    proc = start_collector(config, "--batch", str(batch), "--log-every", "1")
    try:
        wait_for_count(store_url, len(expected), timeout_s, proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, f"restarted collector rc {proc.returncode}: {err[-2000:]}"
    stored = stored_event_ids(store_url)
    assert len(stored) == len(set(stored))
    assert set(stored) == expected, (
        f"{len(expected - set(stored))} events lost, {len(set(stored) - expected)} unexpected")
    return {"kills": kills, "restart": json.loads(out.strip().splitlines()[-1])}
