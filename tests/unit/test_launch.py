"""The stop handlers of dapo_mcore.launch, in this process: a signal only records a stop request, the grace
after SIGTERM ends in Terminated, a second SIGTERM or SIGINT ends the run at once, and a SIGINT whose
KeyboardInterrupt Python dropped still stops the run at the next step boundary."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from dapo_mcore import launch
from dapo_mcore.utils.processes import Terminated


@pytest.fixture
def handlers(monkeypatch):
    monkeypatch.setattr(launch, "_state", launch._StopState())  # the signals recorded here stay in this test
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGALRM)
    saved = {sig: signal.getsignal(sig) for sig in signals}
    saved_hook = sys.unraisablehook
    launch.install_stop_handlers()
    launch.configure_stop(save_on_signal=True, sigterm_grace_s=20.0)
    yield
    sys.unraisablehook = saved_hook
    launch.cancel_grace()
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_sigusr1_only_records_a_stop_request(handlers):
    assert launch.requested_stop() is None
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.01)
    assert launch.requested_stop() == "SIGUSR1"


def test_a_second_sigterm_raises_terminated_at_once(handlers):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.01)
    assert launch.requested_stop() == "SIGTERM"
    with pytest.raises(Terminated):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.0)


def test_sigterm_raises_terminated_when_its_grace_is_over(handlers):
    launch.configure_stop(save_on_signal=True, sigterm_grace_s=0.2)
    os.kill(os.getpid(), signal.SIGTERM)
    start = time.monotonic()
    with pytest.raises(Terminated) as stop:
        time.sleep(5.0)
    assert 0.15 < time.monotonic() - start < 2.0 and stop.value.signal_name == "SIGTERM"


def test_cancelled_grace_lets_the_save_finish(handlers):
    launch.configure_stop(save_on_signal=True, sigterm_grace_s=0.2)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.01)
    launch.cancel_grace()  # the trainer reached the step boundary
    time.sleep(0.5)
    assert launch.requested_stop() == "SIGTERM"


def test_with_save_on_signal_off_sigusr1_stops_at_once(handlers):
    launch.configure_stop(save_on_signal=False, sigterm_grace_s=20.0)
    with pytest.raises(Terminated) as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(1.0)
    assert stop.value.signal_name == "SIGUSR1"


def test_the_stop_file_of_the_batch_script_is_a_stop_request(handlers, tmp_path, monkeypatch):
    stop_file = tmp_path / "attempt-0.stop"
    monkeypatch.setenv(launch.STOP_FILE_ENV, str(stop_file))
    assert launch.requested_stop() is None
    stop_file.touch()  # slurm/train.sbatch on Slurm's USR1
    assert launch.requested_stop() == "Slurm's time-limit warning"


class _InterruptedFinalizer:
    """A finalizer that gets SIGINT: Python prints "Exception ignored in ..." and drops the KeyboardInterrupt,
    as it does in logging's at-fork hook when Ctrl-C lands while the checkpoint writer forks."""

    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler runs here


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # pytest's hook saw it: a failure
def test_a_sigint_whose_keyboard_interrupt_was_dropped_is_still_a_stop_request(handlers, capfd):
    assert launch.requested_stop() is None
    os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: a save at the boundary
    time.sleep(0.05)
    assert launch.requested_stop() == "SIGINT"
    _InterruptedFinalizer()  # the second, in a finalizer collected at once: no exception reaches this frame
    assert launch.requested_stop() == "SIGINT at once"
    said = (
        "dapo-mcore: Ctrl-C: stopping after this step, once it is saved; Ctrl-C again stops at once (the step is lost)"
    )
    assert capfd.readouterr().err == said + "\n"  # and no "Exception ignored ... Traceback" for the second


def test_a_terminated_dropped_where_it_cannot_propagate_still_stops_at_the_boundary(handlers, capsys):
    launch.configure_stop(save_on_signal=False, sigterm_grace_s=20.0)

    class RaisesInDel:  # as a regex object's __del__ run by the garbage collector did in a suite run
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.0)  # the handler runs here and raises Terminated: Python drops it

    RaisesInDel()
    assert launch.requested_stop() == "SIGTERM at once"
    assert capsys.readouterr().err == ""  # no "Exception ignored ... Traceback" for it


def test_the_trainer_ends_a_run_whose_terminated_was_dropped_at_the_step_boundary(monkeypatch):
    from dapo_mcore import trainer

    monkeypatch.setattr(trainer, "agreed_stop", lambda: "SIGUSR1 at once")
    with pytest.raises(Terminated, match="SIGUSR1"):
        trainer.stop_if_signalled(run=None, next_step=3, saved_step=2)  # no save: it was to stop at once


def test_the_first_sigint_asks_for_a_save_and_the_second_raises_keyboard_interrupt_at_once(handlers):
    """Ctrl-C lost every step since the last save (2-4 hours of GPU time at the 7B recipe's save interval); SIGTERM
    saved. Now the first is a stop request like SIGTERM, without its grace timer."""
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)
    assert launch.requested_stop() == "SIGINT" and signal.getitimer(signal.ITIMER_REAL)[0] == 0.0
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)


def test_with_saves_on_signals_off_the_first_sigint_stops_at_once(handlers):
    launch.configure_stop(save_on_signal=False, sigterm_grace_s=20.0)
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)


@pytest.mark.parametrize(
    ("per_rank", "agreed"),
    [
        ([None, None], None),
        ([None, "SIGUSR1"], "SIGUSR1"),
        (["SIGUSR1", "SIGTERM"], "SIGTERM"),
        (["SIGTERM", "SIGINT at once", None], "SIGINT at once"),  # a dropped 2nd Ctrl-C: every rank at once
        (["SIGTERM", "SIGINT"], "SIGINT"),  # a first Ctrl-C: a save, as SIGTERM
        (["SIGTERM", "SIGUSR1 at once"], "SIGUSR1 at once"),  # so does a dropped Terminated
    ],
)
def test_every_rank_agrees_on_the_most_urgent_stop(monkeypatch, per_rank, agreed):
    import dapo_mcore.parallel

    gathered = [([reason, None], False) for reason in per_rank]  # (asked, time limit stop), clock watching
    monkeypatch.setattr(dapo_mcore.parallel, "all_gather_objects", lambda obj: gathered)
    assert launch.agreed_stop() == agreed


def test_the_trainer_ends_a_run_whose_sigint_was_dropped_at_the_step_boundary(monkeypatch):
    from dapo_mcore import trainer

    monkeypatch.setattr(trainer, "agreed_stop", lambda: "SIGINT at once")
    with pytest.raises(KeyboardInterrupt):
        trainer.stop_if_signalled(run=None, next_step=3, saved_step=2)  # no save: a second SIGINT means now


def test_a_forked_helper_leaves_sigint_to_the_run(handlers, tmp_path):
    """The checkpoint writer forks its workers, which inherit the handlers; a Ctrl-C reaches them too (the
    process group) and must not kill them mid-write: the run decides."""
    done = tmp_path / "done"
    pid = os.fork()
    if pid == 0:  # the helper: receives SIGINT, finishes its work
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            done.touch()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert done.exists() and launch.requested_stop() is None


def test_a_saved_stop_is_marked_beside_the_stop_file(monkeypatch, tmp_path):
    """slurm/train.sbatch re-queues on this file when srun reports another code than 75 (it ended a task still
    closing down after the save)."""
    stop = launch.StoppedToResume("Slurm's time-limit warning", 7, tmp_path / "step_000007")
    monkeypatch.delenv(launch.STOP_FILE_ENV, raising=False)
    assert launch.mark_saved_stop(stop) is None  # not under the batch script: nothing to tell
    monkeypatch.setenv(launch.STOP_FILE_ENV, str(tmp_path / "attempt-0.stop"))
    marker = launch.mark_saved_stop(stop)
    assert marker == tmp_path / "attempt-0.stop.saved"
    assert (
        marker.read_text() == f"stopped by Slurm's time-limit warning after step 7; saved to {tmp_path}/step_000007\n"
    )


def test_the_first_task_to_fail_claims_the_error_record_and_prints_it(monkeypatch, tmp_path, capsys):
    """slurm/train.sbatch reports the first failure's code, rank and host: srun reports 143 for the tasks it
    ended after it, and rank 0 (which alone printed an error every rank meets) may be one of them."""
    import socket

    from dapo_mcore import cli

    monkeypatch.delenv(launch.STOP_FILE_ENV, raising=False)
    assert launch.claim_first_error(2, "x") is None  # not under the batch script
    monkeypatch.setenv(launch.STOP_FILE_ENV, str(tmp_path / "attempt-0.stop"))
    monkeypatch.setenv("WORLD_SIZE", "4")
    shared = launch.PreflightError("preflight found problems before training:\n  a problem (ranks 2,3 on node2)")
    shared.same_on_every_rank = True
    monkeypatch.setattr(cli, "_parser", lambda: _failing_parser(shared))
    monkeypatch.setattr(launch, "install_stop_handlers", lambda: None)
    printed = []
    for rank in ("3", "0"):  # rank 3 meets it first; rank 0 later, if srun has not ended it by then
        monkeypatch.setenv("RANK", rank)
        assert cli.main(None) == 2  # as `python -m dapo_mcore.cli` calls it: this process is the run
        printed.append(capsys.readouterr().err)
    assert "a problem (ranks 2,3 on node2)" in printed[0] and printed[1] == ""  # by the first, once
    record = (tmp_path / "attempt-0.stop.error").read_text()
    assert record == f"2 3 {socket.gethostname()}\n{shared}\n"


def _failing_parser(err):
    from types import SimpleNamespace

    def fail(_args):
        raise err

    return SimpleNamespace(parse_known_args=lambda argv: (SimpleNamespace(func=fail), []))


def test_a_mark_that_cannot_be_written_leaves_the_stop_as_it_was(monkeypatch, tmp_path):
    """Exit 75 alone still re-queues: a stop whose mark fails to write must not become a crash."""
    from types import SimpleNamespace

    from dapo_mcore import trainer

    monkeypatch.setattr(trainer, "agreed_stop", lambda: "Slurm's time-limit warning")
    monkeypatch.setenv(launch.STOP_FILE_ENV, str(tmp_path / "missing-dir" / "attempt-0.stop"))
    run = SimpleNamespace(ctx=SimpleNamespace(rank=0), checkpoints=SimpleNamespace(wait=lambda: None))
    with pytest.raises(launch.StoppedToResume, match="nothing trained since the newest save"):
        trainer.stop_if_signalled(run, next_step=3, saved_step=3)
    assert not (tmp_path / "missing-dir").exists()


# Run in a process of its own: end_children ends every process below the caller (a pytest worker's below it
# include the warm CLI servers and their runs).
END_CHILDREN = """
import signal, subprocess, sys, time
from dapo_mcore.utils.processes import end_children
ignoring = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(600)"
marking = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: (open(sys.argv[1], 'w').close(), "
           "sys.exit(0))); print(flush=True); time.sleep(600)")
workers = [subprocess.Popen([sys.executable, "-c", ignoring], stdout=subprocess.PIPE),
           subprocess.Popen([sys.executable, "-c", marking, sys.argv[1]], stdout=subprocess.PIPE)]
for worker in workers:
    worker.stdout.readline()  # started, its SIGTERM disposition set
started = time.monotonic()
print(end_children(timeout_s=30), round(time.monotonic() - started, 1), [w.poll() is not None for w in workers])
"""


def test_end_children_kills_workers_that_ignore_sigterm_without_waiting_for_them(tmp_path):
    import subprocess

    proc = subprocess.run([sys.executable, "-c", END_CHILDREN, str(tmp_path / "termed")], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    count, seconds, ended = proc.stdout.split(maxsplit=2)
    assert int(count) == 2 and ended.strip() == "[True, True]"  # both ended (reaped by end_children)
    assert float(seconds) < 20  # not the 30 s a worker that ignores SIGTERM would be given
    assert (tmp_path / "termed").exists()  # the other one was asked first, with SIGTERM


# --- The run's own stop before the job's time limit (fake clocks: a boundary's `now` is passed in) -------------


@pytest.fixture
def no_job_clock():
    yield
    launch._state.job_clock = None


def job_clock(job_end=1000.0, margin_s=100.0, save_s=50.0, read_end=lambda: None) -> launch.JobClock:
    return launch.JobClock(job_end, margin_s, save_s, read_end, end_read_at=0.0)


def first_stop(clock: launch.JobClock, boundaries) -> float | None:
    """The first boundary at which the clock says stop."""
    return next((now for now in boundaries if clock.at_boundary(now) is not None), None)


def test_the_run_stops_at_the_boundary_where_a_step_and_a_save_no_longer_fit():
    clock = job_clock()  # ends at 1000; a save 50 s, the margin 100 s; steps of 10 s
    assert first_stop(clock, range(0, 1000, 10)) == 850  # 840 + 10 + 50 + 100 = 1000 still fits


def test_the_next_step_is_estimated_by_the_longest_recent_step_not_the_mean():
    clock = job_clock()
    for now in (0.0, 10.0, 70.0, 80.0, 90.0):  # steps of 10, 60, 10, 10 s: mean 22.5, longest 60
        assert clock.at_boundary(now) is None
    assert clock.at_boundary(100.0) is None  # 100 + 60 + 50 + 100 = 310
    clock.last_boundary = 780.0  # a step of 10 s ends at 790: 790 + 60 + 50 + 100 = 1000 still fits
    assert clock.at_boundary(790.0) is None
    reason = clock.at_boundary(800.0)  # 800 + 60 + 50 + 100 = 1010: would end after the job
    assert reason.startswith(launch.TIME_LIMIT_REASON) and "a step of up to 60 s, a save of 50 s" in reason


def test_the_first_boundary_of_an_attempt_never_stops_it():
    """No step timed yet: an attempt always trains a step (a job re-queued into a short window still progresses)."""
    assert job_clock().at_boundary(999.0) is None


def test_a_save_is_not_counted_as_step_time_and_the_last_one_replaces_the_estimate():
    clock = job_clock(save_s=300.0)  # the estimate before a save
    clock.at_boundary(0.0)
    clock.saved(8.0, whole=True)  # a step of 10 s, then a save of 8 s
    clock.at_boundary(18.0)
    assert list(clock.steps) == [10.0] and clock.save_s == 8.0
    clock.saved(2.0, whole=False)  # an async save's foreground part says little of the whole write
    assert clock.save_s == 8.0
    assert first_stop(clock, range(30, 1000, 10)) == 890  # 880 + 10 + 8 + 100 fits (with the estimate: 600)
    assert max(clock.steps) == 10.0  # the 2 s of that async save were not a step's


def test_a_time_limit_extended_during_the_job_is_read_again(monkeypatch):
    clock = job_clock(read_end=lambda: 5000.0)  # `scontrol update TimeLimit=...` moved the end
    clock.at_boundary(500.0)
    assert clock.at_boundary(510.0) is None and clock.job_end == 1000.0  # read 510 s ago: not yet again
    assert clock.at_boundary(900.0) is None and clock.job_end == 5000.0  # read again after END_TIME_REFRESH_S


def test_an_end_time_that_cannot_be_read_again_keeps_the_last_one():
    clock = job_clock(read_end=lambda: None)  # squeue failed this time
    clock.at_boundary(600.0)
    assert clock.at_boundary(990.0).startswith(launch.TIME_LIMIT_REASON) and clock.job_end == 1000.0


def test_the_job_end_comes_from_slurm_job_end_time_else_squeue(monkeypatch):
    monkeypatch.setattr(launch, "squeue_end_time", lambda job_id: 4242.0 if job_id == "17" else None)
    assert launch.job_end_time({"SLURM_JOB_END_TIME": "1764000000", "SLURM_JOB_ID": "17"}) == 1764000000.0
    assert launch.job_end_time({"SLURM_JOB_ID": "17"}) == 4242.0  # Slurm before 23.02 sets no end time
    assert launch.job_end_time({}) is None  # not in a Slurm job


def test_squeue_end_times_are_local_times_and_a_job_without_a_limit_has_none():
    from datetime import datetime

    assert launch.parse_squeue_time("2026-11-25T14:02:11\n") == datetime(2026, 11, 25, 14, 2, 11).timestamp()
    assert launch.parse_squeue_time("N/A\n") is None and launch.parse_squeue_time("Unknown") is None
    assert launch.squeue_end_time("") is None


def test_squeue_missing_or_failing_gives_no_end_time(monkeypatch):
    import subprocess

    def missing(*args, **kwargs):
        raise FileNotFoundError("squeue")

    monkeypatch.setattr(subprocess, "run", missing)
    assert launch.squeue_end_time("17") is None
    failed = subprocess.CompletedProcess([], 1, stdout="", stderr="slurm_load_jobs error: Invalid job id")
    monkeypatch.setattr(subprocess, "run", lambda *args, **kwargs: failed)
    assert launch.squeue_end_time("17") is None


def test_watching_the_time_limit_logs_when_the_job_ends_and_is_off_outside_a_job(no_job_clock):
    environ = {"SLURM_JOB_END_TIME": "4600"}
    line = launch.watch_time_limit(True, 120.0, 10**9, environ, now=lambda: 1000.0)
    end = time.strftime("%H:%M", time.localtime(4600))
    assert line == f"job ends at {end} (in 60 min); stopping and saving by itself when a step + save no longer fit"
    assert launch._state.job_clock.save_s == launch.SAVE_ESTIMATE_FIXED_S + 2.0  # 1 GB at 0.5 GB/s
    assert launch.watch_time_limit(False, 120.0, 10**9, environ) is None  # off, or not rank 0
    assert launch._state.job_clock is None  # a later run in the same process does not inherit the clock
    assert launch.watch_time_limit(True, 120.0, 10**9, {}) is None  # not in a Slurm job


def test_rank_0s_time_limit_stop_joins_the_same_gather_as_the_signals(monkeypatch, no_job_clock):
    import dapo_mcore.parallel

    gathered = []
    other_rank = ([None, None], False)
    monkeypatch.setattr(
        dapo_mcore.parallel, "all_gather_objects", lambda obj: gathered.append(obj) or [obj, other_rank]
    )
    monkeypatch.setattr(launch, "requested_stop", lambda: None)
    launch._state.job_clock = job_clock(job_end=time.time() + 60.0)
    assert launch.agreed_stop() is None  # the first boundary: no step timed yet
    launch._state.job_clock.last_boundary -= 30.0  # a step of 30 s: 30 + 50 + 100 s do not fit in 60
    assert launch.agreed_stop().startswith(launch.TIME_LIMIT_REASON)
    assert len(gathered) == 2  # one gather a boundary, as before: no extra collective


def test_slurms_warning_waits_for_the_clock_while_rank_0_knows_the_jobs_end(monkeypatch, no_job_clock):
    """sbatch --signal=B:USR1@3000 (the default, so that a step and a save fit without the clock) stopped every
    attempt 50 minutes early although the clock knew better."""
    import dapo_mcore.parallel

    warned_rank = ([launch.SLURM_WARNING, None], False)
    monkeypatch.setattr(dapo_mcore.parallel, "all_gather_objects", lambda obj: [obj, warned_rank])
    monkeypatch.setattr(launch, "requested_stop", lambda: launch.SLURM_WARNING)
    launch._state.job_clock = job_clock(job_end=time.time() + 3000.0)
    assert launch.agreed_stop() is None  # the first boundary
    launch._state.job_clock.last_boundary -= 30.0  # a step of 30 s: 30 + 50 + 100 s fit in 3000
    assert launch.agreed_stop() is None
    launch._state.job_clock.job_end = time.time() + 120.0  # now they do not
    assert launch.agreed_stop().startswith(launch.TIME_LIMIT_REASON)
    launch._state.job_clock = None  # no clock (squeue unreadable, or off): the warning stops the run
    assert launch.agreed_stop() == launch.SLURM_WARNING


def test_a_time_limit_stop_creates_the_stop_file_so_the_batch_script_requeues(monkeypatch, tmp_path):
    stop_file = tmp_path / "attempt-0.stop"
    monkeypatch.setenv(launch.STOP_FILE_ENV, str(stop_file))
    warned = launch.StoppedToResume("Slurm's time-limit warning", 7, tmp_path / "step_000007")
    launch.mark_saved_stop(warned)
    assert not stop_file.exists()  # the batch script made it (or a signal came from elsewhere: no re-queue)
    own = launch.StoppedToResume(launch.TIME_LIMIT_REASON + " (a step of up to 9 s ...)", 9, tmp_path / "step_9")
    marker = launch.mark_saved_stop(own)
    assert stop_file.exists() and marker.read_text().startswith("stopped by the job's time limit (a step of up to 9")


def test_a_job_end_that_cannot_be_read_is_said_once_not_silently_ignored(monkeypatch, no_job_clock, caplog):
    """The self-timed stop was turned off without a word when neither SLURM_JOB_END_TIME nor squeue answered."""

    def failing_squeue(*args, **kwargs):
        return subprocess.CompletedProcess(args, 1, "", "slurm_load_jobs error: Unable to contact slurm controller")

    monkeypatch.setattr(launch.subprocess, "run", failing_squeue)
    environ = {"SLURM_JOB_ID": "17", "SLURM_JOB_END_TIME": "soon"}
    with caplog.at_level(logging.WARNING):
        assert launch.watch_time_limit(True, 120.0, 10**9, environ) is None
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("the job's end time could not be read (SLURM_JOB_END_TIME='soon', squeue -j 17 exited 1")
    assert "will not stop and save by itself" in warning
    caplog.clear()
    no_limit = lambda *args, **kwargs: subprocess.CompletedProcess(args, 0, "Unknown\n", "")  # noqa: E731
    monkeypatch.setattr(launch.subprocess, "run", no_limit)  # a job without a time limit: nothing to say
    with caplog.at_level(logging.WARNING):
        assert launch.watch_time_limit(True, 120.0, 10**9, {"SLURM_JOB_ID": "17"}) is None
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


_SIGNAL_IN_FORK_HOOK = {"armed": False, "hook_ran_to_its_end": False}


def _a_packages_fork_hook() -> None:
    """Another package's before-fork hook (registered before guard_forks, as filelock's is by the run's imports),
    in which a SIGTERM lands."""
    if not _SIGNAL_IN_FORK_HOOK["armed"]:
        return
    _SIGNAL_IN_FORK_HOOK["armed"] = False
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)  # the handler runs here
    _SIGNAL_IN_FORK_HOOK["hook_ran_to_its_end"] = True


os.register_at_fork(before=_a_packages_fork_hook)


def test_a_stop_landing_in_a_fork_hook_is_recorded_not_raised_inside_it(handlers):
    """Terminated raised inside filelock's at-fork hook broke its bookkeeping (IndexError, "Exception ignored ...
    Traceback" in a suite run); inside a fork the stop is recorded and the step boundary stops the run."""
    launch.configure_stop(save_on_signal=False, sigterm_grace_s=20.0)  # SIGTERM stops at once
    launch.guard_forks()
    _SIGNAL_IN_FORK_HOOK["armed"] = True
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    assert _SIGNAL_IN_FORK_HOOK["hook_ran_to_its_end"]
    assert launch.requested_stop() == "SIGTERM at once"  # the boundary ends the run (stops_at_once)
