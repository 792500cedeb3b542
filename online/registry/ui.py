"""The MLflow UI over the registry's stores: `livedraft ui` starts `mlflow server` on them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

from online.registry.versions import RegistrySettings, ensure_sqlite_dir


@dataclass
class UiServer:
    process: subprocess.Popen
    url: str

    def wait_ready(self, timeout_s: float = 30.0) -> bool:
        """Blocks until GET /health answers 200 (True), the server exits, or `timeout_s` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1.0) as r:
                    if r.status == 200:
                        return True
            except OSError:
                pass
            try:
                self.process.wait(timeout=0.2)  # doubles as the poll interval; returns at once if it died
                return False
            except subprocess.TimeoutExpired:
                continue
        return False

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminates the server (mlflow forwards the signal to its uvicorn worker) and waits for it."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout_s)


def start_ui(settings: RegistrySettings, *, host: str = "127.0.0.1", port: int = 5000) -> UiServer:
    """Starts `mlflow server` over the registry's stores (one worker, job execution off) and returns at
    once; call `wait_ready()` before opening the URL and `stop()` when done."""
    for uri in {settings.tracking_uri, settings.registry_uri}:
        ensure_sqlite_dir(uri)
    cmd = [sys.executable, "-m", "mlflow", "server",
           "--backend-store-uri", settings.tracking_uri, "--registry-store-uri", settings.registry_uri,
           "--default-artifact-root", settings.artifact_root, "--no-serve-artifacts",
           "--workers", "1", "--host", host, "--port", str(port)]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    proc = subprocess.Popen(cmd, env=env)
    return UiServer(proc, f"http://{host}:{port}")
