"""The stop handlers of dapo_mcore.launch, in this process: a signal only records a stop request, the grace
after SIGTERM ends in Terminated, a second SIGTERM ends the run at once, and a SIGINT whose KeyboardInterrupt
Python dropped still stops the run at the next step boundary."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from dapo_mcore import launch
from dapo_mcore.utils.processes import Terminated


@pytest.fixture
def handlers():
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
def test_a_sigint_whose_keyboard_interrupt_was_dropped_is_still_a_stop_request(handlers, capsys):
    assert launch.requested_stop() is None
    _InterruptedFinalizer()  # collected at once: no exception reaches this frame
    assert launch.requested_stop() == "SIGINT"
    assert capsys.readouterr().err == ""  # no "Exception ignored ... Traceback" for it


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


def test_sigint_raises_keyboard_interrupt_at_once(handlers):
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)


@pytest.mark.parametrize(
    ("per_rank", "agreed"),
    [
        ([None, None], None),
        ([None, "SIGUSR1"], "SIGUSR1"),
        (["SIGUSR1", "SIGTERM"], "SIGTERM"),
        (["SIGTERM", "SIGINT", None], "SIGINT"),  # a dropped Ctrl-C on one rank stops every rank at once
        (["SIGTERM", "SIGUSR1 at once"], "SIGUSR1 at once"),  # so does a dropped Terminated
    ],
)
def test_every_rank_agrees_on_the_most_urgent_stop(monkeypatch, per_rank, agreed):
    import dapo_mcore.parallel

    monkeypatch.setattr(dapo_mcore.parallel, "all_gather_objects", lambda obj: per_rank)
    assert launch.agreed_stop() == agreed


def test_the_trainer_ends_a_run_whose_sigint_was_dropped_at_the_step_boundary(monkeypatch):
    from dapo_mcore import trainer

    monkeypatch.setattr(trainer, "agreed_stop", lambda: "SIGINT")
    with pytest.raises(KeyboardInterrupt):
        trainer.stop_if_signalled(run=None, next_step=3, saved_step=2)  # no save: SIGINT means now


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
        marker.read_text() == f"stopped by Slurm's time-limit warning before step 7; saved to {tmp_path}/step_000007\n"
    )


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
