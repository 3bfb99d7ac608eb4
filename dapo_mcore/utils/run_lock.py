"""One run per run directory: a lock file beside it, held while the run lives.

The lock is `.<run dir name>.lock` next to the run directory (not inside it, so it is never moved with it),
created atomically (O_EXCL) and holding the holder's host, pid and start time. The holder touches it every
HEARTBEAT_S seconds from a daemon thread. A second run refuses at once, naming the holder, unless the holder
is dead: it was an earlier attempt of this same Slurm job (a re-queued job keeps its job id and counts its
restarts, and Slurm ends every process of an attempt before the next starts, on whichever node); on the same
host its pid is gone; on another host its heartbeat is older than the stale timeout. A dead holder's lock is
taken over with a warning.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path

from dapo_mcore.utils.errors import RunLockError, os_reason
from dapo_mcore.utils.logging import get_logger

log = get_logger(__name__)

HEARTBEAT_S = 30.0
# A lock file without its record this long after it was made was never written (its writer failed): not a holder.
UNWRITTEN_GRACE_S = 5.0


def lock_path(run_dir: Path) -> Path:
    return run_dir.parent / f".{run_dir.name}.lock"


class RunLock:
    def __init__(self, run_dir: Path, stale_after_s: float = 300.0):
        self.run_dir, self.path, self.stale_after_s = run_dir, lock_path(run_dir), stale_after_s
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def acquire(self) -> None:
        """Take the lock, or raise RunLockError naming the live holder (or the path that cannot be written: a
        read-only mount, no permission, a full disk or quota); a dead holder's lock is taken over."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise self._cannot("create", err) from None
        for _ in range(3):  # a lost race for a dead holder's lock is retried
            if self._create():
                self._start_heartbeat()
                return
            holder = self._read_holder()
            if holder is None:
                continue  # released or being replaced between our two looks
            reason = self._why_dead(holder)
            if reason is None:
                raise RunLockError(self._in_use(holder))
            self._take_over(holder, reason)
        raise RunLockError(f"could not take the lock {self.path}: other runs keep taking it")

    def live_holder_problem(self) -> str | None:
        """What acquire would refuse with, without taking the lock (`dapo-mcore check`): the live run holding the
        run directory, or None when the lock is free or its holder is gone."""
        holder = self._read_holder()
        if holder is None or self._why_dead(holder) is not None:
            return None
        return self._in_use(holder)

    def write_problem(self) -> str | None:
        """What acquire would meet making the lock file, without making anything (`dapo-mcore check`): the nearest
        existing folder on the way to it is a file, or a folder this process cannot write in. None when it can."""
        where = self.path.parent
        while not where.exists() and where != where.parent:
            where = where.parent
        if not where.is_dir():
            reason = "Not a directory"
        elif os.access(where, os.W_OK | os.X_OK):
            return None
        else:
            reason = "Read-only file system" if os.statvfs(where).f_flag & os.ST_RDONLY else "Permission denied"
        return (
            f"logging.run_dir {self.run_dir}: cannot create its lock file {self.path}: {where} ({reason}); "
            "choose a logging.run_dir where this job can write"
        )

    def _in_use(self, holder: dict) -> str:
        return (
            f"run directory {self.run_dir} is in use by the run of pid {holder.get('pid')} on host "
            f"{holder.get('host')}, started {holder.get('started')}; choose another logging.run_dir, or "
            f"stop that run first (lock file {self.path})"
        )

    def release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
            self._beat = None
        holder = self._read_holder()
        if holder is not None and _is_me(holder):
            try:
                self.path.unlink(missing_ok=True)
            except OSError as err:  # left behind, it is taken over as a dead holder's (its pid is gone)
                log.warning("could not remove the run lock %s (%s)", self.path, os_reason(err))

    def _create(self) -> bool:
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        record |= _slurm_attempt()
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        except OSError as err:  # a read-only mount, no permission, a quota
            raise self._cannot("create its lock file", err) from None
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump(record, fh)
        except OSError as err:  # a full disk: an empty lock left behind read later as "in use by pid None"
            with contextlib.suppress(OSError):
                self.path.unlink(missing_ok=True)
            raise self._cannot("write its lock file", err) from None
        return True

    def _cannot(self, what: str, err: OSError) -> RunLockError:
        where = err.filename if err.filename is not None else self.path
        return RunLockError(
            f"logging.run_dir {self.run_dir}: cannot {what} {where} ({os_reason(err)}); "
            "choose a logging.run_dir where this job can write"
        )

    def _read_holder(self) -> dict | None:
        try:
            holder = json.loads(self.path.read_text())
        except (FileNotFoundError, NotADirectoryError):  # no lock there (none can be: write_problem says why)
            return None
        except (OSError, ValueError):
            holder = {}  # half-written or damaged: judged by its age alone
        try:
            holder["age_s"] = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return None
        return holder

    def _why_dead(self, holder: dict) -> str | None:
        """Why the holder is no longer running, or None while it may be."""
        if "pid" not in holder and holder["age_s"] > UNWRITTEN_GRACE_S:
            return "its lock file is empty or damaged (a writer that failed, or a full disk)"
        mine = _slurm_attempt()
        same_job = bool(mine) and holder.get("slurm_job_id") == mine["slurm_job_id"]
        if same_job and holder.get("slurm_restart_count", -1) < mine["slurm_restart_count"]:
            return f"it was attempt {holder.get('slurm_restart_count')} of this Slurm job {mine['slurm_job_id']}"
        if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
            return None if _pid_alive(holder["pid"]) else f"its pid {holder['pid']} is gone"
        if holder["age_s"] > self.stale_after_s:
            return f"its heartbeat is {holder['age_s']:.0f} s old (more than {self.stale_after_s:.0f} s)"
        return None

    def _take_over(self, holder: dict, reason: str) -> None:
        aside = self.path.with_name(f"{self.path.name}.stale-{os.getpid()}")
        try:
            os.rename(self.path, aside)  # only one of several contenders renames it; the others retry
        except FileNotFoundError:
            return
        except OSError as err:  # a dead run's lock on a mount that is read-only now
            raise self._cannot("take over the ended run's lock file", err) from None
        aside.unlink(missing_ok=True)
        log.warning(
            "taking over the lock of run directory %s from pid %s on host %s: %s",
            self.run_dir, holder.get("pid"), holder.get("host"), reason,
        )  # fmt: skip

    def _start_heartbeat(self) -> None:
        def beat() -> None:
            while not self._stop.wait(HEARTBEAT_S):
                with contextlib.suppress(OSError):  # gone after a take-over: nothing to refresh
                    os.utime(self.path)

        self._beat = threading.Thread(target=beat, name="run-lock-heartbeat", daemon=True)
        self._beat.start()


def _slurm_attempt() -> dict:
    """This process's Slurm job id and restart count ({} outside Slurm)."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return {}
    return {"slurm_job_id": job_id, "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0"))}


def _is_me(holder: dict) -> bool:
    return holder.get("host") == socket.gethostname() and holder.get("pid") == os.getpid()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    """A killed process whose parent has not yet reaped it (a SIGKILLed run's ranks, until init collects them)
    still answers kill(pid, 0), though it runs nothing and holds no lock."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].startswith("Z")
