"""`livedraft ui` as a real process: it prints a URL that answers, and SIGTERM stops it and the MLflow
server it started (no orphan, exit status 0)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from devkit.kafka_broker import free_port


def test_ui_serves_the_registry_and_stops_on_sigterm(tmp_path):
    port = free_port()
    env = {**os.environ, "LIVEDRAFT_DATA_DIR": str(tmp_path)}
    env.pop("LIVEDRAFT_CONFIG", None)
    proc = subprocess.Popen([sys.executable, "-m", "online.cli", "ui", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        lines = []  # the MLflow server shares stdout; our line comes once /health answered
        while not (lines and lines[-1].startswith("MLflow UI:")):
            line = proc.stdout.readline()
            assert line, f"livedraft ui exited early: {''.join(lines)}"
            lines.append(line)
        assert lines[-1].startswith(f"MLflow UI: http://127.0.0.1:{port} "), lines[-1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
            assert r.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        except OSError:
            return  # nothing listens any more: the MLflow server went with it
        time.sleep(0.2)
    raise AssertionError(f"something still listens on port {port} after livedraft ui exited")
