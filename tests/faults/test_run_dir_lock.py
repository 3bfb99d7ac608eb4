"""One run per run directory: a second run into a live run's directory refuses and touches nothing; a lock
left by a dead run (same host: pid gone; another host: stale heartbeat) is taken over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dapo_mcore.utils.errors import RunLockError
from dapo_mcore.utils.run_lock import RunLock, lock_path
from tests.faults.test_signals import start
from tests.warm_cli import WarmProcess


def write_lock(run_dir: Path, host: str, pid: int, age_s: float = 0.0, **slurm) -> Path:
    path = lock_path(run_dir)
    path.write_text(json.dumps({"host": host, "pid": pid, "started": "2026-01-01 00:00:00", **slurm}))
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_holder_is_refused_with_its_host_pid_and_start(tmp_path):
    first = RunLock(tmp_path / "run")
    first.acquire()
    try:
        with pytest.raises(RunLockError, match=rf"is in use by the run of pid {os.getpid()} on host"):
            RunLock(tmp_path / "run").acquire()
    finally:
        first.release()
    assert not lock_path(tmp_path / "run").exists()
    RunLock(tmp_path / "run").acquire()  # free again once released


def test_a_dead_holder_on_this_host_is_taken_over(tmp_path, caplog):
    import socket

    write_lock(tmp_path / "run", socket.gethostname(), dead_pid())
    lock = RunLock(tmp_path / "run")
    lock.acquire()
    assert "is gone" in caplog.text
    assert json.loads(lock_path(tmp_path / "run").read_text())["pid"] == os.getpid()
    lock.release()


def test_a_killed_holder_not_yet_reaped_is_taken_over(tmp_path, caplog):
    """A SIGKILLed run's ranks stay zombies until their new parent reaps them: they answer kill(pid, 0), but hold
    nothing. Seen when an engine-TP-2 run was killed and its next attempt started at once."""
    import socket

    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while not Path(f"/proc/{zombie.pid}/stat").read_text().split(") ")[1].startswith("Z"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    try:
        write_lock(tmp_path / "run", socket.gethostname(), zombie.pid)
        lock = RunLock(tmp_path / "run")
        lock.acquire()
        assert "is gone" in caplog.text
        lock.release()
    finally:
        zombie.wait()


def test_another_hosts_lock_is_taken_over_only_when_its_heartbeat_is_stale(tmp_path, caplog):
    write_lock(tmp_path / "run", "node-17", 4242, age_s=10)
    with pytest.raises(RunLockError, match="pid 4242 on host node-17"):
        RunLock(tmp_path / "run", stale_after_s=300).acquire()
    write_lock(tmp_path / "run", "node-17", 4242, age_s=301)
    lock = RunLock(tmp_path / "run", stale_after_s=300)
    lock.acquire()
    assert "heartbeat is 301 s old" in caplog.text
    lock.release()


def test_a_requeued_slurm_job_takes_over_its_earlier_attempts_lock_at_once(tmp_path, caplog, monkeypatch):
    # the earlier attempt ran on another node a moment ago (fresh heartbeat): only the job id tells it is over
    write_lock(tmp_path / "run", "node-17", 4242, age_s=5, slurm_job_id="812", slurm_restart_count=0)
    monkeypatch.setenv("SLURM_JOB_ID", "813")  # another job: refused
    with pytest.raises(RunLockError, match="pid 4242 on host node-17"):
        RunLock(tmp_path / "run").acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "812")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")  # the same attempt (a second srun in one job): refused
    with pytest.raises(RunLockError, match="pid 4242 on host node-17"):
        RunLock(tmp_path / "run").acquire()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    lock = RunLock(tmp_path / "run")
    lock.acquire()
    assert "it was attempt 0 of this Slurm job 812" in caplog.text
    assert json.loads(lock_path(tmp_path / "run").read_text())["slurm_restart_count"] == 1
    lock.release()


def start_run(run_dir: Path, steps: int) -> WarmProcess:
    """The demo run of the signal tests (a process of its own, forked from a warm server), `steps` long."""
    return start(run_dir, f"trainer.steps={steps}", "checkpoint.save_interval=2")


def test_a_second_run_into_a_live_run_directory_refuses_and_touches_nothing(tmp_path):
    run_dir = tmp_path / "run"
    first = start_run(run_dir, steps=200)
    try:
        deadline = time.time() + 120
        while not (run_dir / "metrics.jsonl").exists():  # the first run is training
            assert first.poll() is None and time.time() < deadline, first.communicate()[1][-3000:]
            time.sleep(0.5)
        second = start_run(run_dir, steps=2)
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2
        assert err.strip().splitlines()[-1].startswith(f"dapo-mcore: error: run directory {run_dir} is in use by")
        assert first.poll() is None  # still running, in its own directory
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith("run.prev-")] == []
        rows = len((run_dir / "metrics.jsonl").read_text().splitlines())
        time.sleep(5)
        assert len((run_dir / "metrics.jsonl").read_text().splitlines()) >= rows
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()


def test_of_two_runs_started_together_one_trains_and_the_other_refuses(tmp_path):
    run_dir = tmp_path / "run"
    runs = [start_run(run_dir, steps=200), start_run(run_dir, steps=200)]
    try:
        deadline = time.time() + 180
        while all(r.poll() is None for r in runs):
            assert time.time() < deadline, "neither run refused"
            time.sleep(0.5)
        refused = next(r for r in runs if r.poll() is not None)
        assert refused.returncode == 2, refused.communicate()[1][-3000:]
        assert "is in use by" in refused.communicate()[1]
        assert all(r.poll() is None for r in runs if r is not refused)  # the other one trains on
        assert not any(p.name.startswith("run.prev-") for p in tmp_path.iterdir())
    finally:
        for r in runs:
            if r.poll() is None:
                r.send_signal(signal.SIGKILL)
                r.wait()


def test_a_lock_that_cannot_be_written_is_one_line_and_leaves_no_empty_lock(tmp_path, monkeypatch):
    """A full disk under the run directory was an ENOSPC traceback and a 0-byte lock, which the next run read as
    "in use by pid None" until its heartbeat grew stale."""
    run_dir = tmp_path / "run"

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(json, "dump", full_disk)
    with pytest.raises(RunLockError, match=r"cannot write its lock file .*No space left on device"):
        RunLock(run_dir).acquire()
    assert not lock_path(run_dir).exists()
    monkeypatch.undo()
    lock_path(run_dir).write_text("")  # as the old code left it
    old = time.time() - 60
    os.utime(lock_path(run_dir), (old, old))
    lock = RunLock(run_dir)
    lock.acquire()  # an empty lock a minute old is no holder: taken over
    lock.release()
