"""What a long run needs from its launcher: stopping cleanly at a step boundary on a signal, and the preflight.

Preflight. Before any model is allocated, every task checks that the layout divides the tasks, that it has
its GPU, that the model's weights are readable and the checkpoint directory writable on its node, that an
all-reduce across every rank completes, and that a save of this model fits the checkpoint directory's free
space. The problems of all ranks are gathered and printed by rank 0, one line each, and every rank exits 2.

Stopping. Slurm warns a job before its time limit with SIGUSR1 to the batch script (`sbatch
--signal=B:USR1@N`), which creates the file named by DAPO_STOP_FILE; SIGUSR1 sent to the run itself (torchrun,
by hand) does the same. Preemption and `scancel` send SIGTERM, then SIGKILL KillWait seconds later (30 s by
default). A handler only records the signal; the trainer asks every rank at the next
step boundary (`agreed_stop`), so all ranks stop after the same step, saves there and raises `StoppedToResume`,
which the CLI turns into exit code 75 (EX_TEMPFAIL: "saved, run me again"); once the save is complete, rank 0
also writes the file DAPO_STOP_FILE + ".saved" (`mark_saved_stop`). The batch script re-queues the job on
either, and the re-queued job resumes from the save. After SIGTERM the step has
`checkpoint.sigterm_grace_s` seconds to reach its boundary; after that (or at a second SIGTERM) the run
unwinds at once as before (`Terminated`, exit 143), keeping every complete save.

SIGINT (Ctrl-C) is a stop request too: the run saves at the next step boundary and exits 75, with no grace
timer (no one kills the run after it). A second SIGINT raises KeyboardInterrupt at once (exit 130, the step in
progress lost), and is also remembered: Python drops an exception raised where it cannot propagate ("Exception
ignored in ..."), e.g. in logging's at-fork hook when the signal lands while the checkpoint writer forks. A run
whose KeyboardInterrupt was dropped so would train on; every rank stops at the next step boundary instead
(`agreed_stop` returns "SIGINT at once"). The same holds
for `Terminated` (seen: dropped in a regex object's __del__ run by the garbage collector, after which the run
ignored every further SIGTERM and trained on): `agreed_stop` returns "SIGTERM at once" (or "SIGUSR1 at once").

The job's end time. Slurm's warning only helps if it comes a step and a save before the limit, and the lead
is a guess made at submission. So rank 0 also reads the job's end (SLURM_JOB_END_TIME, else `squeue`, again
every few minutes: `scontrol update TimeLimit=` moves it), times its own steps and saves (`JobClock`), and at
each step boundary asks whether the longest recent step plus a save plus `checkpoint.time_limit_margin_s` still
end before it; when not, its answer joins the same `agreed_stop` gather as a signal and the run stops the
same way (save, exit 75); rank 0 then creates the stop file itself, so the batch script re-queues as after
Slurm's warning.
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from dapo_mcore.utils.errors import DapoError, PreflightError
from dapo_mcore.utils.logging import get_logger
from dapo_mcore.utils.processes import Terminated

log = get_logger(__name__)
T = TypeVar("T")

# slurm/train.sbatch creates this file when Slurm warns of the time limit. A file, not a signal passed on to
# the tasks: Slurm signals every process of a job step, and the engine's or the verifiers' worker processes
# would die of a SIGUSR1 they do not handle.
STOP_FILE_ENV = "DAPO_STOP_FILE"
AT_ONCE = " at once"  # appended to a signal's name: a stop whose Terminated was dropped (module doc)
RESUME_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): the run saved and stopped early; run it again to continue
SAVED_STOP_SUFFIX = ".saved"
ERROR_SUFFIX = ".error"  # beside the stop file: the first error of the attempt (claim_first_error)
SLURM_WARNING = "Slurm's time-limit warning"  # the stop file slurm/train.sbatch creates on SIGUSR1
TIME_LIMIT_REASON = "the job's time limit"  # the run's own stop: a step and a save would end after the job
END_TIME_REFRESH_S = 600.0  # `scontrol update TimeLimit=` moves the end: read it again this often
# The next step is estimated by the longest of the last RECENT_STEPS (a validation every <= 20 steps is in them,
# a slow first step leaves them); not the mean: one step longer than the estimate costs the work since a save.
RECENT_STEPS = 20
# Before this attempt has timed a save: its size at the write rate of a slow shared file system (0.5 GB/s for a
# whole job's shards), plus a save's own start (planning, forking the writer, checksums).
SAVE_ESTIMATE_BYTES_PER_S = 0.5e9
SAVE_ESTIMATE_FIXED_S = 10.0


class StoppedToResume(Exception):  # noqa: N818 - a way of ending, not a failure
    """The run stopped after a signal at a step boundary, `next_step` updates done; `saved` holds them all."""

    def __init__(self, reason: str, next_step: int, saved: Path | None):
        self.reason, self.next_step, self.saved = reason, next_step, saved
        where = f"saved to {saved}" if saved is not None else "nothing trained since the newest save"
        super().__init__(f"stopped by {reason} after step {next_step}; {where}")


@dataclass
class _StopState:
    reason: str | None = None  # "SIGUSR1" / "SIGTERM" once one arrived
    interrupted: bool = False  # SIGINT arrived (its KeyboardInterrupt may have been dropped: module doc)
    terminated: str | None = None  # the signal a Terminated was raised for (it too may have been dropped)
    run_pid: int = 0  # the process that installed the handlers (forked helpers inherit them)
    save_on_signal: bool = True
    sigterm_grace_s: float = 20.0
    job_clock: JobClock | None = None  # rank 0 under Slurm: when the job ends, how long a step and a save take
    warning_deferred: bool = False  # Slurm's warning came while the clock decides (said once)
    forking: bool = False  # inside os.fork's hooks: a stop that would raise is recorded instead (guard_forks)
    forks_guarded: bool = False


_state = _StopState()


def guard_forks() -> None:
    """Once, after the run's imports: while this process forks (the checkpoint writer's workers), a stop that would
    raise at once is only recorded, and the step boundary stops the run (agreed_stop). Raised inside another
    package's at-fork hook, it broke that hook's bookkeeping: filelock's after-fork hook then failed with
    IndexError, printed as "Exception ignored ... Traceback" (seen in a suite run). Ours run outermost: before-fork
    hooks run in reverse registration order, after-fork hooks in order."""
    if _state.forks_guarded or not hasattr(os, "register_at_fork"):
        return
    _state.forks_guarded = True

    def forking(now: bool) -> None:
        _state.forking = now

    os.register_at_fork(
        before=lambda: forking(True), after_in_parent=lambda: forking(False), after_in_child=lambda: forking(False)
    )


def install_stop_handlers() -> None:
    """In the process that is the run (the CLI): SIGUSR1 / SIGTERM / SIGINT (Ctrl-C) request a stop at the next
    step boundary, after a save; a second SIGINT stops at once, or at the next boundary where its
    KeyboardInterrupt was dropped."""
    _state.reason, _state.interrupted, _state.terminated, _state.run_pid = None, False, None, os.getpid()
    sys.unraisablehook = _quiet_about_dropped_interrupts
    signal.signal(signal.SIGINT, _on_sigint)
    signal.signal(signal.SIGUSR1, _on_usr1)
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGALRM, _on_grace_over)


def configure_stop(save_on_signal: bool, sigterm_grace_s: float) -> None:
    _state.save_on_signal, _state.sigterm_grace_s = save_on_signal, sigterm_grace_s


def requested_stop() -> str | None:
    """Why this rank was asked to stop, if it was: a signal, or the stop file named by DAPO_STOP_FILE."""
    if _state.interrupted:
        return "SIGINT" + AT_ONCE
    if _state.terminated:
        return _state.terminated + AT_ONCE
    if _state.reason is None:
        stop_file = os.environ.get(STOP_FILE_ENV)
        if stop_file and os.path.exists(stop_file):
            return SLURM_WARNING
    return _state.reason


def agreed_stop() -> str | None:
    """Collective: the stop any rank was asked for, the same on every rank (a signal may reach the ranks at
    slightly different times; all of them must stop after the same step)."""
    from dapo_mcore.parallel import all_gather_objects  # not at import: the CLI installs handlers first

    clock = _state.job_clock
    out_of_time = clock.at_boundary(time.time()) if clock is not None else None
    gathered = all_gather_objects(([requested_stop(), out_of_time], clock is not None))
    # While rank 0's clock knows the job's end, it decides: Slurm's warning (sbatch --signal, 50 minutes ahead
    # by default, so that a step and a save fit without the clock) would stop every attempt that much early.
    clock_decides = any(watching for _, watching in gathered)
    deferred = SLURM_WARNING if clock_decides else None
    reasons = [r for asked, _ in gathered for r in asked if r is not None and r != deferred]
    if clock is not None and requested_stop() == SLURM_WARNING and not _state.warning_deferred:
        _state.warning_deferred = True
        log.info("%s: the run goes on until a step and a save no longer fit before the job's end", SLURM_WARNING)
    return min(reasons, key=_urgency) if reasons else None  # the most urgent; among the others, the first


def signalled_stop() -> str | None:
    """Collective, inside a step: the signal any rank got (SIGTERM, SIGINT, SIGUSR1), the same on every rank; None
    without one. The step then skips what its save does not need (the weight push, the held-out check), so that
    the save at the boundary starts within SIGTERM's grace. Slurm's warning and the job's clock are weighed at the
    boundary only (agreed_stop): they may let the run go on."""
    from dapo_mcore.parallel import all_gather_objects

    own = requested_stop()
    gathered = all_gather_objects(own if own not in (None, SLURM_WARNING) else None)
    signals = [reason for reason in gathered if reason is not None]
    return min(signals, key=_urgency) if signals else None


def _urgency(reason: str) -> int:
    order = ("SIGINT" + AT_ONCE, "SIGTERM" + AT_ONCE, "SIGUSR1" + AT_ONCE, "SIGINT", "SIGTERM")
    return order.index(reason) if reason in order else len(order)


def stops_at_once(reason: str) -> str | None:
    """The signal of a stop that was to end the run at once (its Terminated was dropped), else None."""
    return reason.removesuffix(AT_ONCE) if reason.endswith(AT_ONCE) else None


def mark_saved_stop(stop: StoppedToResume) -> Path | None:
    """Rank 0, once the stop's save is complete: write DAPO_STOP_FILE + ".saved" (the stop's message), which
    tells the batch script to re-queue whatever exit code srun reports (after the run's own stop before the
    time limit, DAPO_STOP_FILE too, which the script otherwise creates on Slurm's warning). The tasks leave one
    by one, and `srun --kill-on-bad-exit` ends those still closing down when the first exits 75: srun then
    reports their 143, not 75 (a CI run saw it)."""
    stop_file = os.environ.get(STOP_FILE_ENV)
    if not stop_file:
        return None
    if stop.reason.startswith(TIME_LIMIT_REASON):  # no USR1 came: the stop file tells the script it is time
        Path(stop_file).touch()
    marker = Path(stop_file + SAVED_STOP_SUFFIX)
    marker.write_text(f"{stop}\n")
    return marker


def claim_first_error(exit_code: int, message: str) -> bool | None:
    """The first task of a batch-script attempt to end on an error claims DAPO_STOP_FILE + ".error" (created
    exclusively: its exit code, rank and host, then the message) and prints the error; True for that task,
    False for the others, None outside the script. Without it the message of an error every rank meets (a
    preflight problem) was printed by rank 0 alone, which `srun --kill-on-bad-exit` may end before it prints
    when another task exits first, and the job reported srun's 143 for the tasks it ended, not the error's code
    (a two-node test met both)."""
    stop_file = os.environ.get(STOP_FILE_ENV)
    if not stop_file:
        return None
    record = f"{exit_code} {os.environ.get('RANK', '0')} {socket.gethostname()}\n{message}\n"
    try:
        fd = os.open(stop_file + ERROR_SUFFIX, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except OSError:
        return None  # the log directory is not writable: print as without the script
    with os.fdopen(fd, "w") as fh:
        fh.write(record)
    return True


def leave_with_exit_code() -> None:
    """This process (the run) is leaving with an error's exit code: SIGTERM is ignored from here on. torchrun ends
    the other workers with SIGTERM as soon as the first one exits, and a rank that had raised the same refusal and
    was still tearing down died of it (while Python finalizes, the default action is back): its summary listed that
    rank with exit code -15 beside the others' 2. (A hang in the teardown still ends: the launchers' SIGKILL.)"""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.setitimer(signal.ITIMER_REAL, 0)  # an earlier SIGTERM's grace timer


def cancel_grace() -> None:
    """At the boundary: the save that follows is not cut short by the grace timer (Slurm's SIGKILL may still
    cut it; a partial save is never taken for a complete one and is removed at the next start)."""
    signal.setitimer(signal.ITIMER_REAL, 0)


def _on_sigint(signum, frame) -> None:
    if os.getpid() != _state.run_pid:
        # A forked helper (the checkpoint writer's workers): a Ctrl-C reaches the whole process group, and a
        # worker that died of it would leave the run waiting for its result when the run itself had dropped
        # its KeyboardInterrupt (it stops at the step boundary once the save is complete, or ends its helpers).
        return
    if _state.reason == "SIGINT" or not _state.save_on_signal:  # a second Ctrl-C (or saves on signals off): now
        _state.interrupted = True
        if not _state.forking:  # (inside a fork's hooks: recorded, the boundary stops the run)
            raise KeyboardInterrupt
        return
    # The first: like SIGTERM, a save at the next step boundary (Ctrl-C lost everything since the last save: hours
    # of GPU time at the recipes' save interval), but with no grace timer: no one kills the job after it.
    _state.reason = "SIGINT"
    if os.environ.get("RANK", "0") == "0":  # os.write: a print here could re-enter one the signal interrupted
        os.write(2, b"dapo-mcore: Ctrl-C: stopping after this step, once it is saved; Ctrl-C again stops at once "
                    b"(the step is lost)\n")  # fmt: skip


def _quiet_about_dropped_interrupts(unraisable) -> None:
    """A dropped KeyboardInterrupt or Terminated is handled at the step boundary: no "Exception ignored"
    traceback for it."""
    if unraisable.exc_type not in (KeyboardInterrupt, Terminated):
        sys.__unraisablehook__(unraisable)


def _on_usr1(signum, frame) -> None:
    if not _state.save_on_signal:
        _terminate("SIGUSR1")
    if _state.reason is None:
        _state.reason = "SIGUSR1"


def _on_sigterm(signum, frame) -> None:
    if _state.reason == "SIGTERM" or not _state.save_on_signal:
        _terminate("SIGTERM")  # a second SIGTERM: the user means now
    _state.reason = "SIGTERM"
    signal.setitimer(signal.ITIMER_REAL, max(_state.sigterm_grace_s, 1e-3))


def _on_grace_over(signum, frame) -> None:
    _terminate("SIGTERM")


def _terminate(name: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGALRM):
        signal.signal(sig, signal.SIG_IGN)  # one unwinding at a time
    _state.terminated = name  # in case Python drops the exception (module doc)
    if not _state.forking:  # (inside a fork's hooks: recorded, the boundary stops the run)
        raise Terminated(name)


# --- The job's end time: stopping by itself when a step and a save would no longer fit (module doc) ------------


def step_and_save_fit(now: float, job_end: float, step_s: float, save_s: float, margin_s: float) -> bool:
    """Would a step of `step_s` started `now`, then a save, end `margin_s` before the job's end?"""
    return now + step_s + save_s + margin_s <= job_end


def save_estimate_s(save_bytes: int) -> float:
    """A save's time before one is measured: its size at a slow shared file system's rate (SAVE_ESTIMATE_*)."""
    return SAVE_ESTIMATE_FIXED_S + save_bytes / SAVE_ESTIMATE_BYTES_PER_S


@dataclass
class JobClock:
    """Rank 0's view of the time left: the job's end, the recent steps' and the last save's durations."""

    job_end: float  # Unix time
    margin_s: float
    save_s: float  # the last save's time; before one, save_estimate_s
    read_end: Callable[[], float | None]  # the end again (squeue), None when it cannot be read now
    end_read_at: float
    steps: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))
    last_boundary: float | None = None
    saving_s: float = 0.0  # the saves since the last boundary: not part of a step

    def at_boundary(self, now: float) -> str | None:
        """A step boundary: the reason to stop (TIME_LIMIT_REASON ...) when the next step and a save would
        end too late, else None. Needs one timed step: an attempt always trains a step."""
        if self.last_boundary is not None:
            self.steps.append(now - self.last_boundary - self.saving_s)
        self.last_boundary, self.saving_s = now, 0.0
        if now - self.end_read_at >= END_TIME_REFRESH_S:
            self.job_end, self.end_read_at = self.read_end() or self.job_end, now
        step_s = max(self.steps, default=0.0)
        if not self.steps or step_and_save_fit(now, self.job_end, step_s, self.save_s, self.margin_s):
            return None
        return (
            f"{TIME_LIMIT_REASON} (a step of up to {step_s:.0f} s, a save of {self.save_s:.0f} s and the "
            f"{self.margin_s:.0f} s margin would end after {_clock_time(self.job_end, '%H:%M:%S')})"
        )

    def saved(self, seconds: float, whole: bool) -> None:
        """A save took `seconds`; `whole`: written before it returned (an async save's background part is not
        in `seconds`, so it only ever raises the estimate)."""
        self.saving_s += seconds
        self.save_s = seconds if whole else max(seconds, self.save_s)


def watch_time_limit(enabled: bool, margin_s: float, save_bytes: int, environ: Mapping[str, str] = os.environ,
                     now: Callable[[], float] = time.time, steps_before: list[float] = ()) -> str | None:  # fmt: skip
    """At the start of a run (every rank; `enabled` on rank 0 alone): watch the job's end from here on. Returns
    the line to log, or None (off, not in a Slurm job, or a job without a time limit). `steps_before`: the times
    of the run's last steps before this attempt (a resume's metrics.jsonl), so that its first boundary already
    knows what a step takes (an attempt that cannot fit one is told at once: no_step_fits)."""
    _state.job_clock, _state.warning_deferred = None, False
    job_end = job_end_time(environ) if enabled else None
    if job_end is None:
        problem = unreadable_job_end(environ) if enabled else None
        if problem:
            log.warning(
                "the job's end time could not be read (%s): this run will not stop and save by itself before the "
                "job's time limit; it saves every checkpoint.save_interval steps and on SIGTERM as usual",
                problem,
            )
        return None
    start = now()
    job_id = environ.get("SLURM_JOB_ID", "")
    _state.job_clock = JobClock(job_end, margin_s, save_estimate_s(save_bytes), lambda: squeue_end_time(job_id), start)
    _state.job_clock.steps.extend(steps_before)
    return (
        f"job ends at {_clock_time(job_end, '%H:%M')} (in {(job_end - start) / 60:.0f} min); stopping and saving "
        "by itself when a step + save no longer fit"
    )


def no_step_fits(reason: str) -> str:
    """The time-limit stop at an attempt's first boundary: nothing would be trained and saved by any attempt of
    this length, so a stop-and-requeue would repeat for ever. The one line that ends the run instead."""
    return (
        f"stopping before the first step of this attempt: {reason}, and nothing is trained yet, so every attempt "
        "of this job's length would end the same way; resubmit with a longer --time (`dapo-mcore plan` estimates "
        "a step; the last steps' times are in metrics.jsonl, time/step_s), or set checkpoint.stop_before_time_limit"
        "=false to try the step anyway"
    )


def note_save(seconds: float, whole: bool = True) -> None:
    """The trainer's saves, timed: the next stop before the time limit counts on the last one's time."""
    if _state.job_clock is not None:
        _state.job_clock.saved(seconds, whole)


def job_end_time(environ: Mapping[str, str]) -> float | None:
    """When this Slurm job ends (Unix time): SLURM_JOB_END_TIME (Slurm 23.02 on), else squeue; None outside a
    job, or for a job without a time limit."""
    end = environ.get("SLURM_JOB_END_TIME", "")
    if end.isdigit() and int(end) > 0:
        return float(end)
    return squeue_end_time(environ.get("SLURM_JOB_ID", ""))


def squeue_end_time(job_id: str) -> float | None:
    """`squeue -h -j ID -o %e`: the job's end in local time ("2026-11-25T14:02:11"); None when there is no
    job id or squeue, it fails, or the job has no end ("N/A", "Unknown")."""
    return squeue_end(job_id)[0]


def squeue_end(job_id: str) -> tuple[float | None, str]:
    """(squeue_end_time, why squeue gave no answer: "" when it answered, with an end or with none)."""
    if not job_id:
        return None, "no SLURM_JOB_ID"
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%e"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, f"squeue: {type(err).__name__}: {err}"
    if out.returncode != 0:
        return None, f"squeue -j {job_id} exited {out.returncode}: {' '.join(out.stderr.split())[:200]}"
    return parse_squeue_time(out.stdout), ""


def unreadable_job_end(environ: Mapping[str, str]) -> str | None:
    """Inside a Slurm job whose end time job_end_time could not give: what stood in the way, or None where
    the job simply has no time limit (squeue says N/A or Unknown) or this is no Slurm job."""
    job_id = environ.get("SLURM_JOB_ID", "")
    if not job_id:
        return None
    _, problem = squeue_end(job_id)
    if not problem:
        return None
    raw = environ.get("SLURM_JOB_END_TIME")
    return (f"SLURM_JOB_END_TIME={raw!r}, " if raw is not None else "") + problem


def parse_squeue_time(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text.strip()).timestamp()  # naive: local time, as squeue prints it
    except ValueError:
        return None


def _clock_time(unix_time: float, fmt: str) -> str:
    return time.strftime(fmt, time.localtime(unix_time))


# --- Preflight: what would otherwise fail hours into a job, checked before any model allocation ---------------


def check_this_task(
    device: str, world_size: int, tp: int, pp: int, vpp: int, ep: int = 1, etp: int = 0, cp: int = 1
) -> None:
    """Before the process group: the layout divides the tasks and this task has its GPU (the same verdict on
    every task of a node, so no task waits for one that stopped)."""
    from dapo_mcore.parallel import check_layout  # here: the CLI imports this module before torch is needed

    check_layout(world_size, tp, pp, vpp, ep, etp, cp)
    if device == "cpu":
        return
    import torch

    local_rank, visible = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if device == "cuda" and visible == 0:
        raise PreflightError(f"parallel.device=cuda but no GPU is visible on {socket.gethostname()}")
    if visible and local_rank >= visible:
        raise PreflightError(
            f"task LOCAL_RANK={local_rank} on {socket.gethostname()} has no GPU: {visible} visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start at most {visible} "
            "tasks per node (sbatch --ntasks-per-node) or make every GPU visible to every task"
        )


def path_problems(model_path: str, init: str, checkpoint_dir: Path) -> list[str]:
    """What this task cannot read or write (one line each): the model's weights and the checkpoint directory.
    (Config files, data files and checkpoint paths named in the config are checked by config.validate.)"""
    problems = []
    model = Path(model_path)
    if init == "hf" and not any(os.access(p, os.R_OK) for p in model.glob("*.safetensors")):
        problems.append(f"model.hf_path {model}: no readable *.safetensors weights (model.init=hf)")
    problem = _write_problem(checkpoint_dir)
    if problem:
        problems.append(f"checkpoint directory {checkpoint_dir}: {problem}")
    return problems


def tokenizer_problem(model_path: str) -> str | None:
    """The model directory has no tokenizer files (a weights-only copy): the run could not encode a prompt."""
    names = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if any((Path(model_path) / name).is_file() for name in names):
        return None
    return f"model.hf_path {model_path}: no tokenizer files ({', '.join(names)})"


def room_problem(checkpoint_dir: Path, save_bytes: int) -> str | None:
    """A first save must fit: the free space at the checkpoint directory against the save's estimated size."""
    free = shutil.disk_usage(_existing_ancestor(checkpoint_dir)).free
    if free >= save_bytes:
        return None
    return (
        f"checkpoint directory {checkpoint_dir}: {_size(free)} free, a save of this model needs about "
        f"{_size(save_bytes)} (weights + Adam state); free space or set checkpoint.dir elsewhere"
    )


def raise_shared(problems: list[str]) -> list[str]:
    """Collective: every rank raises PreflightError listing the problems of all ranks (with their hosts), or
    none does. Rank 0 prints it; a node-local problem names the ranks that have it. Returns the hosts that
    checked (every rank's, once each)."""
    from dapo_mcore.parallel import all_gather_objects

    seen: dict[str, list[tuple[int, str]]] = {}  # problem -> the ranks (and their hosts) that have it
    hosts: dict[str, None] = {}
    for rank, (host, lines) in enumerate(all_gather_objects((socket.gethostname(), problems))):
        hosts[host] = None
        for line in lines:
            seen.setdefault(line, []).append((rank, host))
    if seen:
        err = PreflightError(
            "preflight found problems before training:\n" + "\n".join(f"  {p} ({_where(w)})" for p, w in seen.items())
        )
        err.same_on_every_rank = True
        raise err
    return list(hosts)


class PeerFailed(DapoError):
    """A check that every rank runs (agreed) raised something other than a DapoError on another rank (a bug, an
    OSError): that rank prints its traceback; this one stops with a line naming it instead of failing in the next
    collective with a transport error."""

    same_on_every_rank = False
    exit_code = 1  # what the rank with the traceback exits with


def agreed(check: Callable[[], T], group: Any = None) -> T:
    """Collective over `group` (default: every rank): run `check`, a check of the start or the resume that one rank
    may fail alone (a file of its own in the save, its share of the run state, a file its host sees otherwise),
    and agree on the outcome. When it raised a DapoError on any rank, every rank raises the first such rank's
    error, same class and message (same_on_every_rank: printed once, the same exit code everywhere); a rank that
    went on alone used to die in the next collective with gloo's "Connection closed by peer" traceback (exit 1),
    which torchrun then named as the root cause. Another exception is raised, traceback and all, on its rank, and
    as PeerFailed naming it on the others. Returns `check`'s result."""
    from dapo_mcore.parallel import all_gather_objects

    result, own, outcome = None, None, None
    try:
        result = check()
    except DapoError as err:
        own, outcome = err, ("refused", _shareable_class(type(err)), str(err), err.exit_code)
    except Exception as err:  # re-raised below, on this rank, once every rank knows
        own, outcome = err, ("failed", f"{type(err).__name__}: {' '.join(str(err).split())[:300]}")
    outcomes = all_gather_objects(outcome, group=group)
    first = next((rank for rank, found in enumerate(outcomes) if found is not None), None)
    if first is None:
        return result
    kind, *found = outcomes[first]
    if outcomes[first] == outcome and own is not None:  # this rank's own error is the one (its traceback kept)
        if isinstance(own, DapoError):
            own.same_on_every_rank = True
        raise own
    if own is not None and not isinstance(own, DapoError):
        log.error("this rank failed too, after rank %d: %s", first, outcome[1], exc_info=own)
    if kind == "failed":
        raise PeerFailed(f"rank {first} failed: {found[0]} (its traceback is in its output)")
    raise _same_error(*found) from None


def _shareable_class(cls: type[DapoError]) -> type[DapoError]:
    """The error's class where every rank can unpickle it (a module's own), else DapoError."""
    try:
        pickle.loads(pickle.dumps(cls))
    except Exception:
        return DapoError
    return cls


def _same_error(cls: type[DapoError], message: str, exit_code: int) -> DapoError:
    try:
        err = cls(message)
    except Exception:  # a class that takes other arguments: its message and exit code on a plain DapoError
        err = DapoError(message)
    err.same_on_every_rank, err.exit_code = True, exit_code
    return err


def check_all_reduce(device: Any, timeout_s: float) -> str:
    """Collective: an all-reduce across every rank completes within `timeout_s` and sums right (a broken
    fabric or NCCL setting fails here, not in the first update); returns a line for the log."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size()
    numel = (64 << 20) // 4 if device.type == "cuda" else (1 << 20) // 4  # 64 MiB on a GPU: the real data path
    payload = torch.ones(numel, dtype=torch.float32, device=device)
    start = time.perf_counter()
    work = dist.all_reduce(payload, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as err:
        raise PreflightError(f"an all-reduce across {world} ranks did not end in {timeout_s:.0f} s: {err}") from None
    took = time.perf_counter() - start
    if not torch.all(payload == world):
        raise PreflightError(f"an all-reduce across {world} ranks summed wrong ({payload[0].item()} != {world})")
    bus = 2 * (world - 1) / world * payload.numel() * 4 / max(took, 1e-9) / 1e9
    mib = payload.numel() * 4 >> 20
    return f"all-reduce of {mib} MiB across {world} ranks: {took * 1e3:.1f} ms ({bus:.1f} GB/s bus)"


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _write_problem(directory: Path) -> str | None:
    """Why files cannot be written in `directory`, or None: a real write in it, or in the nearest existing
    directory above it (nothing is created before the run takes its lock), since permissions say nothing for
    root and a read-only mount says nothing in its permissions."""
    where = _existing_ancestor(directory)
    try:
        probe = where / f".preflight-{socket.gethostname()}-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as err:
        return f"cannot write in {where} ({err.strerror or err})"
    return None


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.1f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.1f} MiB"


def _where(ranks_hosts: list[tuple[int, str]]) -> str:
    ranks = [rank for rank, _ in ranks_hosts]
    hosts = sorted({host for _, host in ranks_hosts})
    listed = ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}..{ranks[-1]}, {len(ranks)} in all"
    return f"rank{'s' if len(ranks) > 1 else ''} {listed} on {', '.join(hosts[:4])}{' ...' if len(hosts) > 4 else ''}"
