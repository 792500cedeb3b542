"""`livedraft daemon` as a real process: it collects the embedded SQL stream into the store while it
runs, and SIGTERM drains — traces emitted just before the signal are stored, the cache maintainer
writes its snapshot, the process exits 0. Plus the in-process Daemon on a failing trainer."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from devkit.synthetic import synthetic_trace
from online.cache import snapshot_paths
from online.config import Config, DaemonConfig
from online.store import Store
from online.stream.sql import SqlSink
from tests.polling import wait_for


def traces(n: int, seed: int) -> list:
    rng = random.Random(seed)
    return [synthetic_trace(rng, prompt_len=8, output_len=24, vocab=512) for _ in range(n)]


def test_sigterm_drains_the_stream_into_the_store(tmp_path: Path):
    data = tmp_path / "data"
    env = {**os.environ, "LIVEDRAFT_DATA_DIR": str(data), "LIVEDRAFT_DAEMON__INTERVAL_S": "0",
           "LIVEDRAFT_DAEMON__MIN_NEW_TRACES": "0", "LIVEDRAFT_CACHE__SNAPSHOT_EVERY_N": "100000"}
    env.pop("LIVEDRAFT_CONFIG", None)
    url = f"sqlite:///{data / 'livedraft.db'}"
    store = Store.open(url)
    sink = SqlSink(store)
    first = traces(20, 1)
    for t in first:
        sink.emit(t)
    assert sink.flush(10)
    proc = subprocess.Popen([sys.executable, "-m", "online.cli", "daemon"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: store.count() == 20 or proc.poll() is not None, 60, "the daemon to collect")
        assert proc.poll() is None, proc.stdout.read()
        for t in traces(30, 2):
            sink.emit(t)
        assert sink.flush(10)
        proc.send_signal(signal.SIGTERM)  # at once: the last 30 are most likely still in the stream
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    sink.close()
    assert proc.returncode == 0, out
    assert "draining" in out and "livedraft daemon: stopped" in out
    assert store.count() == 50
    assert snapshot_paths(data / "cache", "suffix"), "the cache maintainer did not snapshot on drain"
    store.close()


class NoChampion:
    name = "livedraft-drafter"

    def champion(self):
        from online.registry import RegistryError

        raise RegistryError("no champion yet")


def test_daemon_survives_a_trainer_without_a_champion(tmp_path: Path):
    from online.daemon import Daemon
    from online.stream.memory import MemoryStream

    cfg = Config(data_dir=str(tmp_path), daemon=DaemonConfig(min_new_traces=5, check_interval_s=0.05,
                                                             window_traces=10, holdout_traces=2, cache=False))
    stream = MemoryStream()
    store = Store.open(cfg.store_url())
    daemon = Daemon(cfg, store=store, source=stream.source("g"), registry=NoChampion())
    sink = stream.sink()
    daemon.start()
    try:
        for t in traces(12, 3):
            sink.emit(t)
        wait_for(lambda: daemon.trainer.stats.failed >= 1, 30, "a failed round (no champion yet)")
        assert store.count() == 12
        failed = [o for o in daemon.trainer.stats.history if o.status == "failed"]
        assert "RegistryError: no champion yet" in failed[0].reason
    finally:
        report = daemon.stop(timeout_s=10)
    assert report.round_finished
    assert stream.committed("g") == 12
    store.close()


def test_stop_signals_drain_first_and_quit_on_the_second():
    """`daemon`, `up` and `serve` share this: SIGTERM/SIGINT asks for a drain; a second signal
    during the drain interrupts it (KeyboardInterrupt, exit 130); the old handlers come back."""
    from online.commands.daemon import install_stop_signals

    before = signal.getsignal(signal.SIGTERM)
    stop = threading.Event()
    restore = install_stop_signals(stop)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(5)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises here, at once
    finally:
        restore()
    assert signal.getsignal(signal.SIGTERM) is before


def test_stop_makes_no_final_pass_beside_a_collector_that_is_still_blocked(tmp_path: Path, monkeypatch, caplog):
    """A collector thread still blocked in its source (a hanging broker or store) when stop()'s
    join ends: the final pass is skipped, not run beside it on the same source (a Kafka consumer
    is not shared across threads); its records stay uncommitted for the next start."""
    from online import daemon as daemon_mod
    from online.daemon import Daemon
    from online.stream.memory import MemoryStream

    monkeypatch.setattr(daemon_mod, "JOIN_GRACE_S", 0.2)
    cfg = Config(data_dir=str(tmp_path), daemon=DaemonConfig(cache=False))
    stream = MemoryStream()
    stream.sink().emit(traces(1, 4)[0])
    inner, entered, release, pollers = stream.source("g"), threading.Event(), threading.Event(), []

    class Hanging:
        def __getattr__(self, name):
            return getattr(inner, name)

        def poll(self, *args, **kwargs):
            pollers.append(threading.current_thread().name)
            entered.set()
            release.wait(30)
            return []

    store = Store.open(cfg.store_url())
    daemon = Daemon(cfg, store=store, source=Hanging(), registry=NoChampion(), trainer=False)
    daemon.start()
    try:
        assert entered.wait(10)
        with caplog.at_level("WARNING", logger="online.daemon"):
            report = daemon.stop(timeout_s=0.1)
        assert report.collected_on_drain == 0 and "collector is still busy" in caplog.text
        assert set(pollers) == {"livedraft-collector"}, pollers
        assert stream.committed("g") == 0
    finally:
        release.set()
        store.close()
