"""TrainerService: rounds never raise, failures are retried, rounds never overlap under the real
APScheduler triggers, the new-traces trigger counts, and a drain abandons at the safe point."""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from online.config import Config, ConfigError, DaemonConfig, TrainerConfig
from online.registry import LocalDrafter, LoggedRound
from online.trainer.common import NotEnoughData, TrainingError, check_config
from online.trainer.round import TraceWindow, catch_up
from online.trainer.scheduler import LINEAGE_DIR, TrainerService
from runtime.errors import ModelLoadError
from runtime.loader import OPTIMIZER_STATE
from runtime.trace import DraftCounts, RequestTrace, StepRecord


class FakeStore:
    def __init__(self, n: int = 0) -> None:
        self.n = n
        self.windows = 0
        self.modes: list[str] = []  # the holdout each window was read with

    def count(self, tag=None, after_id=0):
        return self.n - after_id

    def max_id(self):
        return self.n

    def training_window(self, limit, holdout, tag=None, mode="newest"):
        self.windows += 1
        self.modes.append(mode)
        if self.n < 2:
            raise NotEnoughData(f"{self.n} traces")
        return TraceWindow([], [], start=max(1, self.n - limit + 1), end=self.n)


class FakeRegistry:
    def __init__(self, tmp: Path) -> None:
        self.version = 1
        self.logged: list = []
        self.path = tmp

        self.trainee: int | None = None

    def champion(self):
        return LocalDrafter(self.version, self.path)

    def champion_version(self):
        return self.version

    def log_round(self, result, target_model="", promote=None):
        self.logged.append(result)
        v = len(self.logged) + 1
        if result.promoted:
            self.version, self.trainee = v, None
        return LoggedRound(f"run-{v}", v, result.promoted)

    def trainee_version(self):
        return self.trainee

    def set_trainee(self, version):
        self.trainee = version

    def download(self, version):
        return self.path / f"v{version}"


@dataclass
class FakeResult:
    promoted: bool
    reason: str
    candidate: SimpleNamespace
    champion: SimpleNamespace
    candidate_dir: Path | None = None


def fake_result(promoted: bool = True, mal: float = 2.0):
    return FakeResult(promoted, "fake verdict", SimpleNamespace(mean_acceptance_length=mal),
                      SimpleNamespace(mean_acceptance_length=1.5))


def service(tmp_path, store, round_fn, **daemon) -> tuple[TrainerService, FakeRegistry]:
    cfg = Config(data_dir=str(tmp_path), daemon=DaemonConfig(**daemon))
    reg = FakeRegistry(tmp_path)
    return TrainerService(cfg, store, reg, round_fn=round_fn), reg


def test_a_failing_round_is_recorded_and_retried(tmp_path):
    calls = []

    def flaky(window, champion_dir, work, cfg, **kw):
        calls.append(work)
        if len(calls) == 1:
            raise RuntimeError("disk full")
        return fake_result()

    svc, reg = service(tmp_path, FakeStore(50), flaky, min_new_traces=10, retry_backoff_s=0.2)
    first = svc.run_round_once()
    assert first.status == "failed" and "RuntimeError: disk full" in first.reason
    assert svc.stats.failed == 1 and reg.logged == []
    assert svc.check_new_traces() is None  # backing off
    time.sleep(0.25)
    second = svc.check_new_traces()
    assert second is not None and second.status == "promoted" and second.version == 2
    assert second.champion_version == 2 and reg.version == 2
    assert svc.stats.consecutive_failures == 0 and svc.stats.promoted == 1
    assert not any(Path(w).exists() for w in calls)  # work dirs are cleaned up either way


def test_lineage_trainee_trains_on_from_the_last_candidate_unless_it_fell_behind(tmp_path):
    parents, caches, verdicts = [], set(), iter([(False, 1.48), (False, 1.2), (True, 2.0), (False, 1.5), (False, 1.5)])

    def round_fn(window, champion_dir, work, cfg, *, parent_dir, parent_version, pass_cache, **kw):
        parents.append((parent_version, parent_dir))
        caches.add(id(pass_cache))  # one cache for every round: the next window overlaps this one
        promoted, mal = next(verdicts)
        return fake_result(promoted, mal)  # the champion scores 1.5; margin 0.05

    cfg = Config(data_dir=str(tmp_path), trainer=TrainerConfig(lineage="trainee"))
    reg = FakeRegistry(tmp_path)
    svc = TrainerService(cfg, FakeStore(50), reg, round_fn=round_fn)
    for _ in range(4):
        assert svc.run_round_once().ok
    assert parents == [
        ("1", tmp_path),  # no trainee yet: from the champion
        ("2", tmp_path / "v2"),  # version 2 lost by 0.02 < margin: the lineage goes on from it
        ("1", tmp_path),  # version 3 lost by 0.3: back to the champion
        ("4", tmp_path),  # version 4 won and is the champion
    ]
    assert reg.trainee == 5
    assert caches == {id(svc.passes)}

    def gone(version):
        raise RuntimeError(f"version {version} was deleted")

    reg.download, reg.trainee = gone, 9  # a trainee deleted by hand: this round trains from the champion
    assert svc.run_round_once().ok and parents[-1] == ("4", tmp_path) and reg.trainee == 6

    plain, seen = Config(data_dir=str(tmp_path), trainer=TrainerConfig(lineage="champion")), []
    svc = TrainerService(plain, FakeStore(50), reg, round_fn=lambda w, c, work, cfg, **kw: seen.append(
        kw["parent_version"]) or fake_result(False, 1.5))
    assert svc.run_round_once().ok and seen == ["4"] and reg.trainee == 6  # lineage "champion": never moves it


def test_a_carried_lineage_keeps_the_trainee_with_its_optimizer_state_for_the_next_round(tmp_path):
    """trainer.carry_optimizer: the trainee's directory (optimizer state included) stays under the
    work dir, the next round trains from it, only the newest is kept, and a lineage that fell
    behind starts again from the champion with no state."""
    parents, verdicts = [], iter([(False, 1.48), (True, 2.0), (False, 1.2), (False, 1.5)])

    def round_fn(window, champion_dir, work, cfg, *, parent_dir, parent_version, **kw):
        state = Path(parent_dir) / OPTIMIZER_STATE
        parents.append((parent_version, state.read_text() if state.is_file() else None))
        out = Path(work) / "cand"
        out.mkdir(parents=True)
        (out / OPTIMIZER_STATE).write_text(f"after round {len(parents)}")
        promoted, mal = next(verdicts)
        return dataclasses.replace(fake_result(promoted, mal), candidate_dir=out)

    cfg = Config(data_dir=str(tmp_path), trainer=TrainerConfig(lineage="trainee", carry_optimizer=True))
    reg = FakeRegistry(tmp_path)
    svc = TrainerService(cfg, FakeStore(50), reg, round_fn=round_fn)
    lineage = tmp_path / "trainer" / LINEAGE_DIR
    for _ in range(4):
        assert svc.run_round_once().ok
        assert len(list(lineage.iterdir())) <= 1
        assert [p.name for p in lineage.iterdir()] == ([f"v{reg.trainee}"] if reg.trainee else [])
    assert parents == [
        ("1", None),  # no trainee yet: the champion, a fresh optimizer
        ("2", "after round 1"),  # version 2 lost by 0.02 < margin: on from it, its state with it
        ("3", "after round 2"),  # version 3 won: the champion and still the lineage, state carried
        ("3", None),  # version 4 fell 0.3 behind: the champion as downloaded, a fresh optimizer
    ]
    assert reg.trainee == 5 and (lineage / "v5" / OPTIMIZER_STATE).read_text() == "after round 4"


def test_a_round_whose_champion_was_rolled_back_meanwhile_neither_promotes_nor_trains_on(tmp_path):
    def round_fn(window, champion_dir, work, cfg, **kw):
        reg.version, reg.trainee = 0, None  # the server rolls version 1 back while the round trains
        return fake_result(promoted=True)

    svc, reg = service(tmp_path, FakeStore(50), round_fn)
    reg.trainee = 1
    out = svc.run_round_once()
    assert out.status == "not_promoted" and "champion moved from version 1 to 0" in out.reason
    assert reg.version == 0 and reg.trainee is None and reg.logged[0].promoted is False


def test_a_window_without_room_for_training_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="holdout_traces < window_traces"):
        service(tmp_path, FakeStore(), fake_result, window_traces=10, holdout_traces=10)
    with pytest.raises(ConfigError, match="holdout must be one of newest, stable, got 'oldest'"):
        service(tmp_path, FakeStore(), fake_result, holdout="oldest")


def test_a_round_reads_its_window_with_the_configured_holdout(tmp_path):
    for holdout in ("newest", "stable"):
        store = FakeStore(50)
        svc, _ = service(tmp_path / holdout, store, lambda *a, **k: fake_result(), holdout=holdout)
        assert svc.run_round_once().ok and store.modes == [holdout]


def test_not_enough_data_is_a_skip_not_a_failure(tmp_path):
    svc, reg = service(tmp_path, FakeStore(1), lambda *a, **k: pytest.fail("must not train"), min_new_traces=1)
    out = svc.run_round_once()
    assert out.status == "skipped" and "1 traces" in out.reason
    assert svc.stats.skipped == 1 and svc.stats.failed == 0
    assert svc.check_new_traces() is None  # the skipped data does not count again


def test_new_traces_trigger_waits_for_n_new_traces(tmp_path):
    store = FakeStore(9)
    svc, reg = service(tmp_path, store, lambda *a, **k: fake_result(promoted=False), min_new_traces=10)
    assert svc.check_new_traces() is None and store.windows == 0
    store.n = 10
    out = svc.check_new_traces()
    assert out.status == "not_promoted" and out.window_end == 10 and out.champion_version == 1
    store.n = 19
    assert svc.check_new_traces() is None and svc.new_traces() == 9
    store.n = 20
    assert svc.check_new_traces().status == "not_promoted"
    assert len(reg.logged) == 2


def test_rounds_never_overlap_under_the_real_scheduler(tmp_path):
    active, peak, done = [0], [0], threading.Event()
    lock = threading.Lock()

    def slow(window, champion_dir, work, cfg, **kw):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.15)
        with lock:
            active[0] -= 1
        return fake_result()

    store = FakeStore(1000)
    svc, reg = service(tmp_path, store, slow, interval_s=0.05, min_new_traces=1, check_interval_s=0.05)

    def grow():  # new traffic keeps arriving so both triggers keep firing
        while not done.is_set():
            store.n += 5
            time.sleep(0.01)

    feeder = threading.Thread(target=grow)
    feeder.start()
    svc.start()
    try:
        deadline = time.monotonic() + 10
        while len(reg.logged) < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        assert svc.stop(timeout_s=5)
        done.set()
        feeder.join()
    assert len(reg.logged) >= 4
    assert peak[0] == 1
    triggers = {o.trigger for o in svc.stats.history}
    assert triggers & {"interval", "new_traces"}
    n = len(reg.logged)
    time.sleep(0.2)
    assert len(reg.logged) == n  # stopped means stopped
    assert svc.run_round_once().status == "stopped"


def test_drain_abandons_a_long_round_before_it_registers(tmp_path):
    entered, release = threading.Event(), threading.Event()

    def blocking(window, champion_dir, work, cfg, **kw):
        entered.set()
        release.wait(10)
        return fake_result()

    svc, reg = service(tmp_path, FakeStore(50), blocking)
    outcomes = []
    t = threading.Thread(target=lambda: outcomes.append(svc.run_round_once()))
    t.start()
    assert entered.wait(5)
    assert svc.stop(timeout_s=0.05) is False
    release.set()
    t.join(5)
    assert outcomes[0].status == "stopped" and reg.logged == []
    assert not svc.running


def test_rounds_train_where_the_target_is_else_on_the_configured_device(tmp_path):
    """A model drafter's round trains on the target's device; a daemon without a target trains on
    [models] device (`livedraft daemon --device` sets it), which is checked when the service starts."""
    seen = []

    def round_fn(window, champion_dir, work, cfg, **kw):
        seen.append(kw["device"])
        return fake_result()

    cfg = Config(data_dir=str(tmp_path))
    cfg.models.device = "cpu"
    assert TrainerService(cfg, FakeStore(50), FakeRegistry(tmp_path), round_fn=round_fn).run_round_once().ok
    target = SimpleNamespace(model=SimpleNamespace(device="cuda:1"), model_id="t")
    assert TrainerService(cfg, FakeStore(50), FakeRegistry(tmp_path), target, round_fn=round_fn).run_round_once().ok
    assert seen == ["cpu", "cuda:1"]
    cfg.models.device = "tpu"
    with pytest.raises(ModelLoadError, match="choose cpu, cuda"):
        TrainerService(cfg, FakeStore(50), FakeRegistry(tmp_path), round_fn=round_fn)


def test_round_directories_a_killed_trainer_left_are_removed_at_start(tmp_path):
    """A kill mid-round used to leave its candidate (and optimizer state) in work_dir for good;
    the kept lineage directory is not a round's and stays."""
    svc, _ = service(tmp_path, FakeStore(0), lambda *a, **kw: fake_result(), interval_s=0, min_new_traces=0)
    left = svc.work_dir / "round-20261128T000000-abc123"
    (left / "cand").mkdir(parents=True)
    (left / "cand" / "optimizer.pt").write_bytes(b"x" * 1000)
    kept = svc.work_dir / LINEAGE_DIR / "v3"
    kept.mkdir(parents=True)
    svc.start()
    try:
        assert not left.exists() and kept.is_dir()
    finally:
        assert svc.stop(timeout_s=5)


def served(request_id: str, accepted: int, drafted: int = 4) -> RequestTrace:
    """A trace whose one verify step drafted `drafted` tokens and kept `accepted` of them."""
    return RequestTrace(request_id, [1, 2], [3, 4, 5, 6, 7], [StepRecord(0, [3] * drafted, "eagle", accepted)],
                        "target", "v1")


def test_a_round_catches_up_after_a_promotion_or_a_shift_in_what_serving_accepted():
    cfg = TrainerConfig(steps=16, catch_up_steps=64, catch_up_ratio=0.6)
    steady = [served(f"r{i}", 2) for i in range(12)]  # acceptance 0.5 throughout
    shifted = steady[:9] + [served(f"s{i}", 1) for i in range(3)]  # the newest quarter at 0.25 < 0.6 * 0.5
    assert catch_up(steady, False, cfg) is None
    assert "promoted" in catch_up(steady, True, cfg)
    why = catch_up(shifted, False, cfg)
    assert why is not None and "newest 3 traces" in why and "0.250" in why and "0.500" in why
    assert catch_up(steady[:9] + [served(f"s{i}", 2, 5) for i in range(3)], False, cfg) is None  # 0.4 >= 0.3
    # with catch_up_answers, a round that trains on answers sampled after a shift catches up, steady traffic or not
    assert catch_up(steady, False, cfg, answers=6) is None  # off by default
    on = dataclasses.replace(cfg, catch_up_answers=True)
    assert catch_up(steady, False, on, answers=6) == "the round trains on 6 answers sampled again after a shift"
    assert "promoted" in catch_up(steady, True, on, answers=6) and catch_up(steady, False, on, answers=0) is None
    # an engine's totals without per-step records (llama-server's) count as its steps would
    totals = [dataclasses.replace(t, steps=[], counts=DraftCounts(1, 4, 1)) for t in shifted[-3:]]
    assert catch_up(steady[:9] + totals, False, cfg) == why
    # nothing drafted (a drafter switched off), or the feature off: no catch-up
    assert catch_up(steady[:9] + [served(f"s{i}", 0, 0) for i in range(3)], False, cfg) is None
    assert catch_up([served(f"s{i}", 0, 0) for i in range(9)] + shifted[-3:], False, cfg) is None
    for off in (TrainerConfig(steps=16), TrainerConfig(steps=16, catch_up_steps=16)):
        assert catch_up(shifted, True, off, answers=6) is None
    with pytest.raises(TrainingError, match="catch_up_ratio"):
        check_config(TrainerConfig(catch_up_ratio=0.0))


def test_the_trainer_trains_a_catch_up_round_after_a_promotion_and_logs_why(tmp_path, caplog):
    steps, verdicts = [], iter([True, False, False, True])

    class Store(FakeStore):
        def training_window(self, limit, holdout, tag=None, mode="newest"):
            return TraceWindow([served(f"r{i}", 2) for i in range(8)], [served("h", 2)], start=1, end=self.n)

    def round_fn(window, champion_dir, work, cfg, **kw):
        steps.append(cfg.steps)
        return fake_result(next(verdicts))

    cfg = Config(data_dir=str(tmp_path), trainer=TrainerConfig(steps=16, catch_up_steps=48))
    svc = TrainerService(cfg, Store(50), FakeRegistry(tmp_path), round_fn=round_fn)
    with caplog.at_level("INFO", logger="online.trainer.scheduler"):
        for _ in range(4):
            assert svc.run_round_once().ok
    assert steps == [16, 48, 16, 16]  # only the round after the promotion catches up
    assert "a catch-up round of 48 steps (instead of 16): the last round's candidate was promoted" in caplog.text


def test_the_trainer_catches_up_on_a_round_that_trains_on_answers_only_with_catch_up_answers(tmp_path, caplog):
    steps: list[int] = []

    class Store(FakeStore):
        def training_window(self, limit, holdout, tag=None, mode="newest"):
            return TraceWindow([served(f"r{i}", 2) for i in range(8)], [served("h", 2)], start=1, end=self.n)

    def round_fn(window, champion_dir, work, cfg, **kw):
        steps.append(cfg.steps)
        return fake_result(False)

    for flag, want in ((True, [16, 48, 48, 16]), (False, [16, 16, 16, 16])):
        steps.clear()
        answered = iter([[], [served("a1", 2)], [served("a1", 2)], []])  # what ShiftAnswers gives rounds 1-4
        cfg = Config(data_dir=str(tmp_path), trainer=TrainerConfig(steps=16, catch_up_steps=48, shift_answers=1,
                                                                   catch_up_answers=flag))
        svc = TrainerService(cfg, Store(50), FakeRegistry(tmp_path), round_fn=round_fn)
        svc.shift_answers.for_round = lambda train, cfg, target, it=answered: next(it)
        with caplog.at_level("INFO", logger="online.trainer.scheduler"):
            for _ in range(4):
                assert svc.run_round_once().ok
        assert steps == want, flag
    assert "a catch-up round of 48 steps (instead of 16): the round trains on 1 answers sampled again" in caplog.text


def answered_fake(calls: list):
    """A stand-in for warmstart.sampled_answers: answer n to prompt [p] is a trace "a<p>-<n>", pass-major
    as the real one returns them."""
    def sampled_answers(target, prompts, max_new_tokens, passes, temperature):
        calls.append(([p[0] for p in prompts], max_new_tokens, passes, temperature))
        return [RequestTrace(f"a{p[0]}-{n}", p, [9], [], "target", "none", temperature=temperature)
                for n in range(passes) for p in prompts]
    return sampled_answers


def numbered(i: int, accepted: int) -> RequestTrace:
    """served(), with prompt [i] and id "r<i>" (so its answers can be told apart)."""
    return dataclasses.replace(served(f"r{i}", accepted), prompt_ids=[i])


def test_after_a_shift_the_target_answers_the_next_prompts_again_up_to_shift_prompts(monkeypatch, caplog):
    import online.trainer.round as round_mod

    calls: list = []
    monkeypatch.setattr(round_mod, "sampled_answers", answered_fake(calls))
    cfg = TrainerConfig(shift_answers=2, shift_prompts=5, shift_temperature=0.8, catch_up_ratio=0.6)
    traffic = [numbered(i, 2) for i in range(12)] + [numbered(i, 0) for i in range(12, 30)]  # 0.5, then 0 at 12
    answers = round_mod.ShiftAnswers()
    target = SimpleNamespace(max_context=64)

    def ids(train) -> list[str]:
        return [a.request_id for a in answers.for_round(train, cfg, target)]

    assert ids(traffic[:12]) == [] and calls == []  # no shift: nothing answered
    with caplog.at_level("INFO", logger="online.trainer.round"):
        got = ids(traffic[4:16])  # the newest quarter (3 of 12) at 0 against 0.5: a shift
    assert calls == [([13, 14, 15], 5, 2, 0.8)]  # the quarter that showed it, each answer as long as the longest
    assert got == ["a13-0", "a13-1", "a14-0", "a14-1", "a15-0", "a15-1"]
    assert "a shift" in caplog.text and "answered 3 new prompts 2 more times" in caplog.text
    # the next round answers its new traces until the shift's 5 prompts are used up, then no more
    assert ids(traffic[8:20])[-4:] == ["a16-0", "a16-1", "a17-0", "a17-1"] and calls[-1][0] == [16, 17]
    assert ids(traffic[12:24]) == [f"a{i}-{n}" for i in range(13, 18) for n in (0, 1)]  # kept, none made
    assert len(calls) == 2
    # answers go with their traces: those that left the window are dropped
    assert ids(traffic[15:27]) == ["a15-0", "a15-1", "a16-0", "a16-1", "a17-0", "a17-1"]
    assert set(answers.answers) == {"r15", "r16", "r17"}
    # off by default; a shift without a target cannot be answered (a warning, not an error)
    assert round_mod.ShiftAnswers().for_round(traffic[4:16], TrainerConfig(), target) == []
    no_target = round_mod.ShiftAnswers()
    with caplog.at_level("WARNING", logger="online.trainer.round"):
        assert no_target.for_round(traffic[4:16], cfg, None) == [] and no_target.left == 0
    assert "no target is loaded" in caplog.text and len(calls) == 2
    for bad in (dict(shift_answers=-1), dict(shift_prompts=-1), dict(shift_answers=2, shift_temperature=0.0)):
        with pytest.raises(TrainingError, match="shift_answers"):
            check_config(TrainerConfig(**bad))


def test_a_shift_answers_only_its_newest_prompts_and_counts_once_until_the_old_traffic_has_left(monkeypatch):
    import online.trainer.round as round_mod

    calls: list = []
    monkeypatch.setattr(round_mod, "sampled_answers", answered_fake(calls))
    cfg = TrainerConfig(shift_answers=1, shift_prompts=2, catch_up_ratio=0.6)
    target = SimpleNamespace(max_context=64)
    answers = round_mod.ShiftAnswers()
    # a quarter of 4 larger than shift_prompts: its 2 newest, not its oldest (which may predate the shift)
    answers.for_round([numbered(i, 2) for i in range(12)] + [numbered(i, 0) for i in range(12, 16)], cfg, target)
    assert calls[-1][0] == [14, 15] and answers.left == 0
    # the budget spent, the shift still shows while the old traffic is in the window: no new budget
    answers.for_round([numbered(i, 2) for i in range(4, 12)] + [numbered(i, 0) for i in range(12, 20)], cfg, target)
    assert len(calls) == 1
    # once the traces from before the shift have left, a new shift counts
    later = [numbered(i, 0) for i in range(12, 24)] + [numbered(i, 2) for i in range(24, 36)]  # 0 then 0.5 ...
    answers.for_round(later + [numbered(i, 0) for i in range(36, 44)], cfg, target)  # ... then 0 again
    assert calls[-1][0] == [42, 43]


def test_answers_that_cannot_be_made_leave_the_round_to_train_without_them(monkeypatch, caplog):
    import online.trainer.round as round_mod

    calls: list = []
    cfg = TrainerConfig(shift_answers=1, shift_prompts=8)
    train = [numbered(i, 2) for i in range(9)] + [numbered(i, 0) for i in range(9, 12)]
    monkeypatch.setattr(round_mod, "sampled_answers", answered_fake(calls))
    long_prompt = dataclasses.replace(train[-1], prompt_ids=[11] * 60)  # 60 + 5 more tokens > a context of 64
    with caplog.at_level("INFO", logger="online.trainer.round"):
        got = round_mod.ShiftAnswers().for_round(train[:-1] + [long_prompt], cfg, SimpleNamespace(max_context=64))
    assert calls == [([9, 10], 5, 1, 0.8)] and len(got) == 2 and "1 too long for 5 more tokens" in caplog.text

    def failing(*a, **kw):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(round_mod, "sampled_answers", failing)
    with caplog.at_level("WARNING", logger="online.trainer.round"):
        assert round_mod.ShiftAnswers().for_round(train, cfg, SimpleNamespace(max_context=64)) == []
    assert "failed (RuntimeError: out of memory); the round trains without them" in caplog.text


def test_the_trainer_trains_on_the_answers_it_sampled_after_a_shift(tmp_path, monkeypatch):
    import online.trainer.round as round_mod

    calls: list = []
    monkeypatch.setattr(round_mod, "sampled_answers", answered_fake(calls))
    windows: list[TraceWindow] = []

    class Store(FakeStore):
        def training_window(self, limit, holdout, tag=None, mode="newest"):
            return TraceWindow([numbered(i, 2) for i in range(9)] + [numbered(i, 0) for i in range(9, 12)],
                               [served("h", 2)], start=1, end=self.n)

    def round_fn(window, champion_dir, work, cfg, **kw):
        windows.append(window)
        return fake_result(False)

    cfg = Config(data_dir=str(tmp_path), trainer=TrainerConfig(shift_answers=1))
    target = SimpleNamespace(model=SimpleNamespace(device="cpu"), model_id="target", max_context=64)
    svc = TrainerService(cfg, Store(50), FakeRegistry(tmp_path), target=target, round_fn=round_fn)
    assert svc.run_round_once().ok
    assert [a.request_id for a in windows[0].answers] == ["a9-0", "a10-0", "a11-0"]
    assert len(windows[0].train) == 12 and windows[0].describe()["answer_traces"] == 3
