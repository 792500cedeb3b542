"""bench_adaptation --window-max: a round's window grows over a steady stream and is cut back at a shift."""

from __future__ import annotations

from bench.adaptation_eagle import round_window
from online.config import TrainerConfig
from runtime.trace import RequestTrace, StepRecord

CFG = TrainerConfig(steps=16, catch_up_steps=64, catch_up_ratio=0.6)


def served(i: int, accepted: int) -> RequestTrace:
    return RequestTrace(f"req-{i}", [1, 2], [3, 4, 5, 6, 7], [StepRecord(0, [3] * 4, "eagle", accepted)],
                        "target", "v1")


def every_eighth(window: list[RequestTrace]) -> set[int]:
    return {i for i in range(len(window)) if i % 8 == 7}


def ids(traces: list[RequestTrace]) -> list[int]:
    return [int(t.request_id[4:]) for t in traces]


def test_off_the_window_is_the_newest_traces():
    stream = [served(i, 2) for i in range(100)]
    base_train, window, since = round_window(stream, 0, 32, 0, every_eighth, CFG)
    assert ids(window) == list(range(68, 100)) and since == 0
    assert ids(base_train) == [i for i in range(68, 100) if (i - 68) % 8 != 7]


def test_a_steady_stream_grows_the_window_up_to_its_cap():
    stream = [served(i, 2) for i in range(100)]
    assert ids(round_window(stream[:20], 0, 32, 64, every_eighth, CFG)[1]) == list(range(20))
    assert ids(round_window(stream[:50], 0, 32, 64, every_eighth, CFG)[1]) == list(range(50))
    base_train, window, since = round_window(stream, 0, 32, 64, every_eighth, CFG)
    assert ids(window) == list(range(36, 100)) and since == 0
    assert ids(base_train) == [i for i in range(68, 100) if (i - 68) % 8 != 7]  # the rules still read 32


def test_a_shift_cuts_the_window_back_and_it_regrows_from_the_shift():
    stream = [served(i, 2) for i in range(90)] + [served(i, 0) for i in range(90, 200)]
    _, window, since = round_window(stream[:100], 0, 32, 64, every_eighth, CFG)
    assert 90 <= since < 100 and ids(window) == list(range(68, 100))  # cut to the base: old traces still in it
    # seen again while the shift is within the base: the same shift, `since` stays
    assert round_window(stream[:110], since, 32, 64, every_eighth, CFG)[2] == since
    # once there are 32 traces after it, the window is exactly what came after the shift, then grows
    _, window, again = round_window(stream[:since + 40], since, 32, 64, every_eighth, CFG)
    assert again == since and ids(window) == list(range(since, since + 40))
    _, window, _ = round_window(stream, since, 32, 64, every_eighth, CFG)
    assert ids(window) == list(range(136, 200))
