import time

import pytest

from dapo_mcore.rewards import pool as pool_module
from dapo_mcore.rewards.pool import VerifierPool
from dapo_mcore.utils.errors import ConfigError


@pytest.fixture
def pool_factory():
    pools = []

    def make(spec, **kwargs):
        pools.append(VerifierPool(spec, **kwargs))
        return pools[-1]

    yield make
    for pool in pools:
        pool.close()


def test_a_hung_check_times_out_counts_as_wrong_and_the_others_still_finish(pool_factory):
    pool = pool_factory("tests.verifiers:hang_on_hmm", workers=2, timeout_s=0.5)
    start = time.monotonic()
    verdicts = pool.verify([("Answer: 3", "3"), ("hmm Answer: 3", "3"), ("Answer: 4", "3"), ("hmm", "1")])
    assert time.monotonic() - start < 5
    assert [(v.correct, v.timed_out) for v in verdicts] == [(True, False), (False, True), (False, False), (False, True)]
    assert [v.correct for v in pool.verify([("Answer: 1", "1")] * 3)] == [True] * 3  # replaced workers work


def test_a_raising_verifier_counts_as_wrong_and_keeps_its_error(pool_factory):
    pool = pool_factory("tests.verifiers:raise_on_boom", workers=1)
    verdicts = pool.verify([("boom", "1"), ("Answer: 1", "1")])
    assert verdicts[0].correct is False and "ValueError: verifier bug" in verdicts[0].error
    assert verdicts[1].correct is True


def test_a_dying_worker_is_replaced(pool_factory):
    pool = pool_factory("tests.verifiers:die_on_crash", workers=1)
    verdicts = pool.verify([("crash", "1"), ("Answer: 1", "1")])
    assert verdicts[0].error == "verifier worker died" and verdicts[1].correct


def test_in_process_mode_needs_no_workers(pool_factory):
    assert pool_factory("dapo", workers=0).verify([("Answer: 2", "2")])[0].correct


@pytest.mark.parametrize(
    "spec, message",
    [("nonsense", "must be given as 'package.module:function'"), ("tests.verifiers:absent", "cannot be loaded")],
)
def test_bad_verifier_specs_are_config_errors(spec, message):
    with pytest.raises(ConfigError, match=message):
        VerifierPool(spec)


def test_a_large_batch_of_slow_checks_gets_time_per_answer_and_is_all_checked(pool_factory):
    """40 checks of 0.1 s on one worker take 4 s: a fixed budget of 1 s cut 30 of them off (each counted as a
    timed-out wrong answer, and 32 in a row stopped the run); the budget now grows with the answers."""
    pool = pool_factory("tests.verifiers:slow_check", workers=1, batch_timeout_s=1.0, timeout_per_answer_s=0.2)
    verdicts = pool.verify([("Answer: 1", "1")] * 40)
    assert [v.correct for v in verdicts] == [True] * 40
    assert pool.budget_s(40) == pytest.approx(1.0 + 0.2 * 40)


def test_checks_that_take_most_of_their_share_of_the_budget_are_said_once(pool_factory, caplog):
    pool = pool_factory("tests.verifiers:slow_check", workers=1, batch_timeout_s=1.0, timeout_per_answer_s=0.11)
    pool.verify([("Answer: 1", "1")] * 16)
    pool.verify([("Answer: 1", "1")] * 16)
    assert caplog.text.count("a check takes 0.1") == 1 and "timeout_per_answer_s (0.11)" in caplog.text


def test_answers_left_when_the_budget_runs_out_are_unchecked_and_not_taken_for_a_hung_verifier(pool_factory, caplog):
    from dapo_mcore.rollout.user_functions import VerdictCheck

    pool = pool_factory("tests.verifiers:slow_check", workers=1, batch_timeout_s=0.5, timeout_per_answer_s=0.0)
    verdicts = pool.verify([("Answer: 1", "1")] * 60)
    unchecked = [v for v in verdicts if v.unchecked]
    assert 40 <= len(unchecked) < 60 and all(v.timed_out and not v.correct for v in unchecked)
    assert f"{len(unchecked)} of 60 answers were not checked within this call's budget" in caplog.text
    VerdictCheck(pool.verify)(verdicts, "test")  # 40+ in a row, yet no "timed out on 32 answers in a row" stop


def test_auto_workers_grow_with_the_batch_up_to_the_hosts_share(pool_factory, monkeypatch):
    from dapo_mcore.rewards import pool as pool_module

    monkeypatch.setattr(pool_module, "host_workers", lambda: 3)
    pool = pool_factory("dapo", workers=pool_module.AUTO)
    assert [pool.workers_for(n) for n in (1, 256, 257, 600, 10_000)] == [1, 1, 2, 3, 3]
    assert [v.correct for v in pool.verify([("Answer: 2", "2")] * 600)] == [True] * 600
    assert len(pool._workers) == 3


def test_host_workers_share_the_nodes_cpus_among_its_gpu_processes(monkeypatch):
    from dapo_mcore.rewards import pool as pool_module

    monkeypatch.setattr(pool_module.os, "sched_getaffinity", lambda _: set(range(128)))
    monkeypatch.setattr(pool_module.os, "cpu_count", lambda: 128)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert pool_module.host_workers() == 15
    monkeypatch.setattr(pool_module.os, "sched_getaffinity", lambda _: set(range(12)))  # bound: its own CPUs
    assert pool_module.host_workers() == 11


def test_a_verifier_that_never_returns_is_said_at_its_first_timeout_and_stops_restarting_with_the_budget(
    pool_factory, caplog
):
    """At the default timeouts a verifier that hung on every answer ran over 6 minutes without a line: its first
    timeout was said only once the whole batch had ended, and timed-out workers were restarted past the budget."""
    pool = pool_factory("tests.verifiers:hang_on_hmm", workers=1, timeout_s=0.3, batch_timeout_s=1.0)
    start = time.time()
    verdicts = pool.verify([("hmm", "1")] * 20)
    end = time.time()
    said = [r for r in caplog.records if "ran past algorithm.reward.timeout_s (0.3 s)" in r.getMessage()]
    assert len(said) == 1 and said[0].created - start < 1.0 < end - start  # said at once, not at the end
    assert all(v.timed_out and not v.correct for v in verdicts)
    assert sum(not v.unchecked for v in verdicts) <= 4  # 1 s at 0.3 s a check: none begins once it is spent
    assert end - start < 1.0 + pool.startup_timeout_s


def test_a_verifier_that_never_returns_stops_the_run_at_its_first_call_within_its_timeout(pool_factory):
    """It cost a round's whole budget (over 5 minutes at the defaults) every round, training on all-wrong rewards,
    until 32 timeouts in a row stopped the run; now the probe answer, judged before the first checks, stops it."""
    pool = pool_factory("tests.verifiers:never_returns", workers=2, timeout_s=0.3, batch_timeout_s=60.0)
    start = time.time()
    with pytest.raises(pool_module.VerifierHangs, match=r"=tests\.verifiers:never_returns did not judge a one-line"):
        pool.verify([("Answer: 1", "1")] * 40)
    assert time.time() - start < 0.3 + pool.startup_timeout_s
    assert all(not worker.process.is_alive() for worker in pool._workers[:1])  # the hung one was stopped


def test_a_verifier_that_hangs_on_some_answers_passes_the_probe_and_counts_them_wrong(pool_factory):
    pool = pool_factory("tests.verifiers:hang_on_hmm", workers=1, timeout_s=0.1, batch_timeout_s=60.0)
    verdicts = pool.verify([("hmm", "1")] * 3 + [("Answer: 2", "2")])
    assert [v.timed_out for v in verdicts] == [True] * 3 + [False] and verdicts[3].correct


def test_a_pace_that_outruns_the_budget_is_said_at_the_first_checks_and_progress_is_noted(pool_factory, caplog):
    """V4: a verifier of 12 s a check passed the start-up probe, then nothing was printed for 5 minutes until the
    budget cut answers off. Here 0.1 s checks against a budget of 1.5 s for 30 answers (3 s of checks): said
    after the first check, long before the budget, with the knob and a value; the progress line gets notes."""
    from dapo_mcore.utils import progress

    notes: list[tuple[float, str]] = []
    progress._note_observers.append(lambda text: notes.append((time.monotonic(), text)))
    try:
        pool = pool_factory("tests.verifiers:slow_check", workers=1, batch_timeout_s=0.5, timeout_per_answer_s=1 / 30)
        start = time.time()  # as log records' times
        pool.verify([("Answer: 1", "1")] * 30)
    finally:
        progress._note_observers.clear()
    said = [r for r in caplog.records if "at this pace the call needs about" in r.getMessage()]
    assert len(said) == 1 and said[0].created - start < 0.6 * pool.budget_s(30)
    assert "raise algorithm.reward.timeout_per_answer_s to" in said[0].getMessage()
    assert notes and notes[0][1].startswith("verifying 1/30 answers")
    assert any(text.startswith("verifying 14/30") for _, text in notes)
