"""One supervised llama-server process (an "upstream"): start, health, requests in flight, stop.

livedraft starts llama-server itself on a free loopback port, waits for its /health, and
counts the requests it forwards there, so a retired upstream (after a hot-swap) is stopped
only once it has finished what it serves. Its stderr goes to a log file; the last lines are
kept for the error a client sees when the process dies.
"""

from __future__ import annotations

import atexit
import collections
import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from runtime.errors import LivedraftError
from runtime.inflight import InFlight

log = logging.getLogger(__name__)
SIGILL_HINT = (" (an illegal instruction: this llama-server runs kernels this CPU cannot; a binary built "
               "elsewhere, or by an older livedraft, which kept llama.cpp's AMX kernels: "
               "`livedraft engine install llama-server --force` builds one here)")


BIND_FAILURE = "couldn't bind HTTP server socket"  # llama-server's log line when its port is taken
BIND_ATTEMPTS = 3


class UpstreamError(LivedraftError):
    """llama-server did not start, died, or failed a request; the message says why."""


@dataclass(frozen=True)
class SpecParams:
    """How llama-server drafts with a head: its own rule is a fixed n-max and a probability floor.
    `n_max` 0 serves the target alone (no head loaded)."""

    n_max: int = 0
    p_min: float = 0.0

    def args(self, head: Path | None) -> list[str]:
        if head is None or self.n_max < 1:
            return []
        return ["-md", str(head), "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(self.n_max),
                "--spec-draft-n-min", "0", "--spec-draft-p-min", f"{self.p_min:.4f}"]


@dataclass(frozen=True)
class LaunchSpec:
    """Everything a llama-server process is started with."""

    binary: Path
    model: Path  # the target GGUF
    head: Path | None = None  # an EAGLE-3 head GGUF
    spec: SpecParams = SpecParams()
    threads: int = 0  # 0: llama-server's default
    parallel: int = 4  # slots: requests decoded together
    ctx_per_slot: int = 2048
    flash_attn: str = ""  # llama-server's -fa (on, off, auto); empty: its default
    extra: tuple[str, ...] = ()
    log_dir: Path | None = None

    def argv(self, port: int) -> list[str]:
        argv = [str(self.binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(port),
                "-np", str(self.parallel), "-c", str(self.ctx_per_slot * self.parallel), "--no-webui"]
        if self.threads > 0:
            argv += ["-t", str(self.threads), "-tb", str(self.threads)]
        if self.flash_attn:
            argv += ["-fa", self.flash_attn]
        return argv + self.spec.args(self.head) + list(self.extra)


_LIVE: weakref.WeakSet[Upstream] = weakref.WeakSet()  # started here: stopped at exit whatever path it took


@atexit.register
def _stop_all() -> None:
    for up in list(_LIVE):
        up.kill()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(eq=False)  # a process handle: identity, hashable (the exit hook's WeakSet)
class Upstream:
    """A llama-server process serving one drafter version (`version`) with `launch`."""

    launch: LaunchSpec
    version: str = "none"
    port: int = 0
    process: subprocess.Popen | None = None
    restarting: bool = False  # between a (re)start and its first healthy answer
    head_rule: tuple[Path, SpecParams] | None = None  # the head and rule the cost rule chose (RuleGuard)
    _retired: bool = False
    _inflight: InFlight = field(default_factory=InFlight)
    _tail: collections.deque = field(default_factory=lambda: collections.deque(maxlen=20))
    _reader: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, timeout_s: float = 120.0) -> Upstream:
        """Starts the process and blocks until /health answers 200. Raises UpstreamError (with the
        process's last log lines) when it exits or is not healthy within `timeout_s`. A free port is
        chosen before llama-server binds it, so another process can take it between the two: a start
        that could not bind is tried again on another port, up to BIND_ATTEMPTS times."""
        self.restarting = True
        try:
            for attempt in range(1, BIND_ATTEMPTS + 1):
                self._tail.clear()
                try:
                    self._start(timeout_s)
                    break
                except UpstreamError:
                    if attempt == BIND_ATTEMPTS or not any(BIND_FAILURE in ln for ln in self._tail):
                        raise
                    log.warning("llama-server for drafter %s could not bind port %d (taken since it was chosen): "
                                "starting it again on another", self.version, self.port)
        finally:
            self.restarting = False
        return self

    def _start(self, timeout_s: float) -> None:
        self.port = free_port()
        argv = self.launch.argv(self.port)
        log.info("starting llama-server for drafter %s: %s", self.version, " ".join(argv))
        try:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE, start_new_session=True)
        except OSError as e:
            raise UpstreamError(f"cannot run llama-server {self.launch.binary}: {e.strerror or e}") from e
        _LIVE.add(self)
        log.info("llama-server for drafter %s: pid %d, port %d", self.version, self.process.pid, self.port)
        self._reader = threading.Thread(target=self._read_log, name=f"llama-server-log-{self.port}", daemon=True)
        self._reader.start()
        try:
            self.wait_healthy(timeout_s)
        except UpstreamError:
            self.kill()
            raise

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive:
                code = self.process.returncode
                hint = SIGILL_HINT if code in (-signal.SIGILL, 128 + signal.SIGILL) else ""
                raise UpstreamError(f"llama-server exited with code {code} while starting{hint}: {self.last_words()}")
            if self.healthy() and self.alive:  # a 200 from a process that has exited came from another one
                return
            if time.monotonic() > deadline:
                raise UpstreamError(f"llama-server was not healthy within {timeout_s:.0f}s: {self.last_words()}")
            time.sleep(0.05)

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)
            conn.request("GET", "/health")
            ok = conn.getresponse().status == 200
            conn.close()
            return ok
        except OSError:
            return False

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`."""
        if not self.alive:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        if self.alive:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(5)

    def last_words(self) -> str:
        if self._reader is not None and not self.alive:
            self._reader.join(1.0)  # a process that exited: its last lines may still be in the pipe
        lines = [ln for ln in self._tail if ln.strip()]
        return " | ".join(lines[-3:]) if lines else "(no output)"

    def failure(self, what: str) -> str:
        """Why a request to this upstream broke: the process's exit when it died (waited for
        briefly: a dropped connection can come before the kernel reaps the process), else `what`."""
        if self.process is not None:
            try:
                self.process.wait(1.0)
            except subprocess.TimeoutExpired:
                return what
        return self.exit_reason()

    def exit_reason(self) -> str:
        code = self.process.returncode if self.process is not None else None
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return f"llama-server (drafter {self.version}) {how}: {self.last_words()}"

    def _read_log(self) -> None:
        proc = self.process
        out = None
        if self.launch.log_dir is not None:
            self.launch.log_dir.mkdir(parents=True, exist_ok=True)
            out = open(self.launch.log_dir / f"llama-server-{self.version}-{self.port}.log", "a")  # noqa: SIM115
        try:
            for raw in proc.stderr:
                line = raw.decode("utf-8", "replace").rstrip()
                self._tail.append(line)
                if out is not None:
                    out.write(line + "\n")
        finally:
            if out is not None:
                out.close()

    # -- requests in flight (for a drain after a swap) ---------------------------------------

    def enter(self) -> None:
        self._inflight.enter()

    def leave(self) -> None:
        self._inflight.leave()

    @property
    def served(self) -> int:
        """Requests finished here."""
        return self._inflight.finished

    @property
    def retired(self) -> bool:
        return self._retired

    def retire(self, timeout_s: float = 300.0) -> None:
        """Blocks until nothing is in flight here (or `timeout_s`), then stops the process."""
        self._retired = True
        if not self._inflight.drain(timeout_s):
            log.warning("llama-server of drafter %s still had %d request(s) after %.0fs; stopping it",
                        self.version, self._inflight.count, timeout_s)
        self.stop()
        log.info("llama-server of drafter %s stopped after %d request(s)", self.version, self.served)

    # -- one request --------------------------------------------------------------------------

    def open_stream(self, body: dict, timeout_s: float) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """POSTs a streaming /completion; returns the connection and the response (status 200).
        Raises UpstreamError when the server cannot be reached or refuses the request."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)
        try:
            conn.request("POST", "/completion", body=json.dumps(body), headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
        except OSError as e:
            conn.close()
            raise UpstreamError(self.failure(f"llama-server unreachable: {e}")) from e
        if resp.status != 200:
            detail = resp.read(2000).decode("utf-8", "replace")
            conn.close()
            raise UpstreamError(f"llama-server answered {resp.status}: {detail}")
        return conn, resp
