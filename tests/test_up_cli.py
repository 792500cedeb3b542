"""`livedraft up --demo` as a real process on the story model (the main job's wiring): it serves, collects,
trains through the scheduler, hot-swaps, prints the acceptance per drafter version, drains, exits 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from devkit.models import stories_copy


def test_up_demo_runs_the_whole_loop_and_exits_cleanly(tmp_path):
    target = stories_copy(tmp_path)
    env = {**os.environ}
    env.pop("LIVEDRAFT_CONFIG", None)
    # a fixed draft length: this test checks that the loop learns and serves what it learned; how much the
    # adaptive rule drafts on a target this small follows its noisy cost measurements (test_adaptive's job)
    env["LIVEDRAFT_SERVE__ADAPTIVE"] = "false"
    cmd = [sys.executable, "-m", "online.cli", "up", "--demo", "--target", str(target), "--learned", "model",
           "--layers", "2",
           "--data-dir", str(tmp_path / "data"), "--demo-seconds", "20", "--demo-max-seconds", "150"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert "livedraft up: serving" in out and "livedraft traffic --url http://127.0.0.1:" in out
    assert re.search(r"demo: \[\s*\d+s\] \d+ done, 0 failed", out)
    rounds = re.search(r"(\d+) trainer rounds: ([a-z_, ]+);", out)
    assert rounds and re.search(r"(^|, )promoted", rounds.group(2)), out
    assert "round in flight finished" in out
    # per drafter version: requests, mean acceptance length, tokens/s, x the target alone (same run)
    assert re.search(r"target alone \(every 4th request, same server, same run\): [\d.]+ tokens/s", out), out
    versions = re.findall(r"^\s+(\d+) \|\s+(\d+) \|\s+([\d.]+) \|\s+([\d.]+) \|\s+([\d.]+)x$", out, re.M)
    assert versions[0][0] == "1" and len(versions) >= 2, out  # the served version changed
    later = [v for v in versions[1:] if int(v[1]) >= 5]  # promoted versions that served enough to judge
    assert later, versions
    assert max(float(v[2]) for v in later) > float(versions[0][2]), versions  # acceptance rose
    # tokens/s against the target alone is printed for each version (the regex above); whether it rose is a
    # timing, which a test shares with whatever else the machine runs: bench/ and the demo's own table judge it
    assert all(float(v[3]) > 0 and float(v[4]) > 0 for v in versions), versions
