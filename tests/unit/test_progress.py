"""The console's step counter: step N = N updates done, as in metrics.jsonl, the saves and the stop messages. Without
the live bar (a task's log file), a long phase gets a progress line every DAPO_PROGRESS_EVERY_S."""

import logging
import time

import pytest

from dapo_mcore.utils import progress
from dapo_mcore.utils.progress import RunProgress, every_s_from_env, note, summary_line
from dapo_mcore.utils.timers import PhaseTimer, _observers, phase_scope


def test_the_summary_line_names_the_step_the_update_completes():
    assert summary_line(3, 60, {"rollout/accuracy": 0.5}).startswith("step 3/60 | acc 0.500")


def test_the_bar_of_a_finished_run_says_every_step_is_done_not_a_step_past_the_end():
    """It read `DAPO step 61` after a 60-step run."""
    progress = RunProgress(enabled=True, total_steps=2, live=True)
    with progress:
        progress.resume_at(1)
        assert progress._progress.tasks[0].description == "step 2: generating"
        progress.step_done(2, {})
        task = progress._progress.tasks[0]
        assert (task.completed, task.description) == (2, "2 steps done")


def test_a_log_file_gets_no_live_bar_and_its_steps_summary_lines(caplog):
    """Under Slurm rank 0's stderr is the task's log file: rich drew nothing there until the run ended."""
    caplog.set_level(logging.INFO, logger=progress.log.name)
    run = RunProgress(enabled=True, total_steps=2)  # pytest's captured stderr is no terminal
    with run:
        run.step_done(1, {"rollout/accuracy": 0.25})
    assert run._progress is None
    assert [r.getMessage() for r in caplog.records] == ["step 1/2 | acc 0.250"]


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lines_while(run: RunProgress, clock: FakeClock, seconds: int, tick: float = 1.0) -> list[tuple[float, str]]:
    """Advance the clock through `seconds`, polling as the run's thread does; the lines written, with their time."""
    out = []
    for _ in range(int(seconds / tick)):
        clock.now += tick
        line = run.poll()
        if line is not None:
            out.append((clock.now, line))
    return out


@pytest.fixture
def info(caplog):
    caplog.set_level(logging.INFO, logger=progress.log.name)
    return caplog


def test_a_long_phase_writes_a_line_every_period_naming_the_step_the_phase_and_the_round(info):
    clock = FakeClock()
    run = RunProgress(enabled=False, total_steps=60, every_s=120, clock=clock, thread=False)
    run.resume_at(2)
    with run:
        timer = PhaseTimer()
        with phase_scope("step"), timer.phase("generate"):
            run.round_done()  # the first round ended; the second is generating
            lines = lines_while(run, clock, 1000)
    assert [t - 1000 for t, _ in lines] == [120, 240, 360, 480, 600, 720, 840, 960]  # one every 120 s, none between
    assert lines[0][1] == "step 3/60, 2 min in: generating (round 2), 2 min so far"
    assert lines[-1][1] == "step 3/60, 16 min in: generating (round 2), 16 min so far"
    assert [r.getMessage() for r in info.records] == [line for _, line in lines]


def test_a_note_goes_into_the_next_line_and_the_update_and_the_save_are_named(info):
    clock = FakeClock()
    run = RunProgress(enabled=False, total_steps=60, every_s=60, clock=clock, thread=False)
    with run:
        with phase_scope("step"):
            with phase_scope("reward"):
                clock.now += 30
                note("verifying 100/12288 answers (30 s of a 684 s budget)")  # within the period: no line
                clock.now += 31
                note("verifying 5120/12288 answers (61 s of a 684 s budget)")  # the period is over: a line
            with phase_scope("update"):
                got = lines_while(run, clock, 130)
        run.step_done(1, {})
        with phase_scope("save"):
            saving = lines_while(run, clock, 60)
        after = lines_while(run, clock, 300)  # between steps: nothing to say
    said = [r.getMessage() for r in info.records]
    assert said[0] == (
        "step 1/60, 61 s in: scoring the answers (round 1), 61 s so far: verifying 5120/12288 answers (61 s of a "
        "684 s budget)"
    )
    assert [line for _, line in got] == [
        "step 1/60, 2 min in: updating the actor, 60 s so far",
        "step 1/60, 3 min in: updating the actor, 2 min so far",
    ]
    assert [line for _, line in saving] == ["saving step 1, 60 s so far"]
    assert after == []


def test_between_phases_the_line_says_what_came_last(info):
    """A dynamic-sampling filter, the held-out check: inside the step, outside any timed phase."""
    clock = FakeClock()
    run = RunProgress(enabled=False, total_steps=4, every_s=10, clock=clock, thread=False)
    with run:
        with phase_scope("step"):
            with phase_scope("reward"):
                clock.now += 3
            between = lines_while(run, clock, 10)
        held_out = lines_while(run, clock, 10)
    assert [line for _, line in between] == ["step 1/4, 10 s in: after scoring the answers (round 1), 7 s so far"]
    assert [line for _, line in held_out] == [
        "step 1/4, 20 s in: the step's end (the held-out check, when due), 7 s so far"
    ]


def test_the_lines_come_from_a_thread_in_real_time_and_stop_with_the_run(info):
    run = RunProgress(enabled=False, total_steps=2, every_s=0.2)
    with run, phase_scope("step"), phase_scope("update"):
        time.sleep(1.1)
    said = [r.getMessage() for r in info.records]
    assert 3 <= len(said) <= 6 and all(line.startswith("step 1/2, ") and "updating the actor" in line for line in said)
    assert run._thread is None and run not in _observers and progress._note_observers == []


def test_no_lines_where_the_bar_is_live_or_the_log_hides_info_or_the_period_is_0(caplog):
    caplog.set_level(logging.WARNING, logger=progress.log.name)  # the other ranks' logs
    assert not RunProgress(enabled=False, total_steps=2, every_s=1).lines
    caplog.set_level(logging.INFO, logger=progress.log.name)
    assert RunProgress(enabled=False, total_steps=2, every_s=1).lines
    assert not RunProgress(enabled=True, total_steps=2, every_s=1, live=True).lines
    assert not RunProgress(enabled=False, total_steps=2, every_s=0).lines


def test_the_period_comes_from_dapo_progress_every_s():
    assert every_s_from_env({}) == 120
    assert every_s_from_env({"DAPO_PROGRESS_EVERY_S": "5"}) == 5
    assert every_s_from_env({"DAPO_PROGRESS_EVERY_S": "0"}) == 0
    assert every_s_from_env({"DAPO_PROGRESS_EVERY_S": "soon"}) == 120
