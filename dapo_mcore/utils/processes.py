"""Clean ends: SIGTERM as an exception (as SIGINT is), child processes that end with the run.

SIGINT and SIGTERM (the latter once its grace for a save at the step boundary is over: dapo_mcore.launch)
unwind the stack, so the trainer's `finally` blocks shut the engine, the verifier workers
and the run-directory lock down; the CLI then prints one line and exits 130 / 143. What is left of the
process tree (e.g. the checkpoint writer's helper processes) is ended by `end_children`. Workers this project
starts also die with their parent when it is killed outright (SIGKILL), through Linux's parent-death signal.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import getpass
import hashlib
import multiprocessing
import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

_PR_SET_PDEATHSIG = 1


class Terminated(BaseException):
    """SIGTERM arrived (scancel, preemption, a time limit): unwinds like KeyboardInterrupt."""

    def __init__(self, signal_name: str = "SIGTERM"):
        super().__init__(signal_name)
        self.signal_name = signal_name


def die_with_parent() -> None:
    """In a worker process: be killed when the parent dies (Linux), and leave SIGINT and SIGTERM to the parent,
    which ends its workers itself: a Ctrl-C reaches the whole process group, and Slurm's SIGTERM (scancel,
    preemption, the time limit) every process of the job step, while the parent may still need its workers
    to finish the step and save (dapo_mcore.launch)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before we asked: its signal will never come
        os._exit(1)


def die_with_launcher() -> None:
    """A rank torchrun started (in a session of its own: a signal to torchrun's process group misses it): SIGTERM
    when torchrun dies, so that a SIGKILL of the launcher's group ends its ranks, saving at the step boundary
    within the grace or stopping (dapo_mcore.launch), instead of leaving them to fail on its store for minutes."""
    if not sys.platform.startswith("linux") or not os.environ.get("TORCHELASTIC_RUN_ID"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() == 1:  # the launcher died before we asked
        os.kill(os.getpid(), signal.SIGTERM)


def end_children(timeout_s: float = 2.0) -> int:
    """Terminate (then kill) every process below this one; returns how many there were. Our own workers ignore
    SIGTERM (die_with_parent): they are killed at once rather than after `timeout_s`."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.Error):
            if _ignores_sigterm(child.pid):
                child.kill()
            else:
                child.terminate()
    _, alive = psutil.wait_procs(children, timeout=timeout_s)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()
    return len(children)


def _ignores_sigterm(pid: int) -> bool:
    """Whether SIGTERM is in the process's ignored-signals mask (Linux /proc; False where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            mask = next(line.split()[1] for line in status if line.startswith("SigIgn:"))
    except (OSError, StopIteration):
        return False
    return bool(int(mask, 16) >> (signal.SIGTERM - 1) & 1)


def adopt_run_tmp(run_dir: str, rank: int) -> Path:
    """This rank's temporary directory for the run (TMPDIR and tempfile's for this process and its children):
    <system tmp>/dapo_mcore-<hash of the run directory>-rank<R>, holding its owner's pid. The processes the run
    starts make their temporary files there (multiprocessing's pymp-* sockets, the engines'). A normal exit
    removes it; after a kill -9 it stays until the run directory's next start, which removes it once its owner
    is gone (they stayed in /tmp for good). While a live run holds it, a second start (one the run lock will
    refuse) takes <that>-pid<P>: its exit would otherwise remove the live run's files."""
    path = run_tmp_of(run_dir, rank)
    for earlier in (path, *path.parent.glob(f"{path.name}-pid*")):
        if earlier.is_dir() and not _alive(_read_pid(earlier / "pid")):
            shutil.rmtree(earlier, ignore_errors=True)  # a killed run's leftovers
    if path.is_dir() and _read_pid(path / "pid") != os.getpid():
        path = path.with_name(f"{path.name}-pid{os.getpid()}")
    path.mkdir(exist_ok=True)
    (path / "pid").write_text(f"{os.getpid()}\n")
    keep_caches_out_of_the_run_tmp()
    os.environ["TMPDIR"] = tempfile.tempdir = str(path)
    me = os.getpid()
    atexit.register(lambda: os.getpid() == me and shutil.rmtree(path, ignore_errors=True))
    return path


@contextlib.contextmanager
def run_tmp(run_dir: str, rank: int) -> Iterator[Path]:
    """adopt_run_tmp for the length of a run: TMPDIR and tempfile's directory are given back after it, so that a
    run called from Python (a test, a notebook) leaves its process as it found it; the processes it starts
    later would otherwise make their files in this run's directory, which goes at exit."""
    tmpdir_before, tempdir_before = os.environ.get("TMPDIR"), tempfile.tempdir
    try:
        yield adopt_run_tmp(run_dir, rank)
    finally:
        tempfile.tempdir = tempdir_before
        if tmpdir_before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = tmpdir_before


def keep_caches_out_of_the_run_tmp() -> None:
    """Caches kept under the temporary directory by default stay where they were (a user's setting wins): the
    run's own directory goes with the run, and torch's compile cache (/tmp/torchinductor_<user>, which vLLM's
    compiled graphs use) would be rebuilt by every run and every resume."""
    try:
        user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())  # as torch names it (cache_dir_utils.py)
    except (KeyError, OSError):  # no name for this uid (a container without a passwd entry)
        user = f"uid_{os.getuid()}"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_SYSTEM_TMP, f"torchinductor_{user}"))


def run_tmp_of(run_dir: str, rank: int) -> Path:
    """Where adopt_run_tmp puts a run's rank's temporary files (under the system's temporary directory)."""
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    return Path(_SYSTEM_TMP) / f"dapo_mcore-{digest}-rank{rank}"


_SYSTEM_TMP = tempfile.gettempdir()  # at import, before a run's TMPDIR replaces it


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process of that pid
        return True
    return True
