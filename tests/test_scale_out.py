"""The scale-out recipe from the command line alone: a Kafka-protocol broker, PostgreSQL (when one is
reachable, else SQLite), an MLflow tracking server; `livedraft drafter register` bootstraps the champion,
`livedraft daemon --target` collects and trains, `livedraft serve --watch-registry` serves and hot-swaps.
A trainer round promotes a version and serve swaps it in; the topic has the configured partitions."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from devkit.kafka_broker import free_port
from online.traffic.generator import run_traffic
from tests.polling import wait_for
from tests.serving_utils import request
from tests.store_fixtures import pg_schema_url, pg_unavailable

REPO = Path(__file__).resolve().parents[1]


def start_mlflow_server(tmp_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow-server.db'}",
         "--artifacts-destination", str(tmp_path / "mlflow-artifacts"), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"})
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise RuntimeError("mlflow server exited")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    wait_for(up, 120, "the MLflow tracking server", 0.5)
    return proc, url


def stop(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return proc.returncode, out or ""


@pytest.mark.slow
def test_daemon_and_serve_from_the_cli_promote_and_swap(kafka_broker, stories, stories_drafter_dir, tmp_path):
    drop = None
    if pg_unavailable():
        store_url = f"sqlite:///{tmp_path / 'store.db'}"
    else:
        store_url, drop = pg_schema_url()
    mlflow, tracking = start_mlflow_server(tmp_path)
    topic = f"scale-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "LIVEDRAFT_DATA_DIR": str(tmp_path / "data"),
           "LIVEDRAFT_STREAM__KIND": "kafka", "LIVEDRAFT_STREAM__BOOTSTRAP_SERVERS": kafka_broker.bootstrap,
           "LIVEDRAFT_STREAM__TOPIC": topic, "LIVEDRAFT_STREAM__PARTITIONS": "2",
           "LIVEDRAFT_STORE__URL": store_url, "LIVEDRAFT_REGISTRY__TRACKING_URI": tracking,
           "LIVEDRAFT_DAEMON__INTERVAL_S": "0", "LIVEDRAFT_DAEMON__MIN_NEW_TRACES": "16",
           "LIVEDRAFT_DAEMON__CHECK_INTERVAL_S": "1", "LIVEDRAFT_DAEMON__WINDOW_TRACES": "24",
           "LIVEDRAFT_DAEMON__HOLDOUT_TRACES": "6", "LIVEDRAFT_DAEMON__COLLECTOR_POLL_S": "0.2",
           "LIVEDRAFT_TRAINER__STEPS": "60", "LIVEDRAFT_TRAINER__PROMOTE_MARGIN": "0.2",
           "LIVEDRAFT_SERVE__POLL_S": "1", "LIVEDRAFT_SERVE__ADAPTIVE": "false", "LIVEDRAFT_SERVE__TORCH_THREADS": "1",
           "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("LIVEDRAFT_CONFIG", None)
    cli = [sys.executable, "-m", "online.cli"]
    daemon = serve = None
    try:
        reg = subprocess.run([*cli, "drafter", "register", str(stories_drafter_dir), "--alias", "champion"],
                             env=env, capture_output=True, text=True, timeout=120)
        assert reg.returncode == 0 and "version 1 (champion)" in reg.stdout, reg.stderr
        daemon = subprocess.Popen([*cli, "daemon", "--target", str(stories.path)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        serve = subprocess.Popen([*cli, "serve", "--target", str(stories.path), "--watch-registry", "--port", "0"],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = serve.stdout.readline()
            if not line and serve.poll() is not None:
                break
            if m := re.search(r"on (http://[\d.]+:\d+)", line):
                url = m.group(1)
        assert url, f"serve did not start: {stop(serve)[1][-2000:]}"
        prompts = ["Once upon a time, there was a little girl named Lily.", "Tom had a red ball. He",
                   "One day, a big bear went to the park.", "The cat sat on the mat and"] * 12
        swapped = False
        for _ in range(3):  # a round every 16 new traces: keep serving until the new champion serves
            run_traffic(url, prompts, rate=0, max_tokens=40, concurrency=2, on_line=None)
            try:
                wait_for(lambda: request(url, "GET", "/v1/drafter")[1]["version"] != "1", 90,
                         "serve to swap in a promoted version", 1.0)
                swapped = True
                break
            except AssertionError:
                continue
        status, drafter, _ = request(url, "GET", "/v1/drafter")
        assert swapped, (drafter, stop(daemon)[1][-3000:])
        assert drafter["swaps"] >= 1 and int(drafter["version"]) >= 2
        from kafka import KafkaAdminClient

        admin = KafkaAdminClient(bootstrap_servers=kafka_broker.bootstrap)
        try:
            assert len(admin.describe_topics([topic])[0]["partitions"]) == 2
        finally:
            admin.close()
        code, out = stop(serve)
        assert code == 0, out[-2000:]
        code, out = stop(daemon)
        assert code == 0 and "promoted" in out, out[-3000:]
    finally:
        for p in (serve, daemon):
            if p is not None and p.poll() is None:
                p.kill()
        mlflow.terminate()
        mlflow.wait(30)
        if drop is not None:
            drop()
