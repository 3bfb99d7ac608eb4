"""What a person watching a run sees: a bar over RL steps (rank 0, on a terminal) and one summary line per step.

Where there is no live bar (rank 0's log is a file, as a Slurm task's is, or logging.progress=false), a step of
hours would otherwise show nothing until it ends: rank 0 then writes a progress line at least every
DAPO_PROGRESS_EVERY_S seconds (120) while a step, a save or a restore is under way, naming the phase, how long
it has run, the generation round and the latest note of a long part (`note`: the verifiers' answers checked).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from dapo_mcore.utils.logging import get_logger
from dapo_mcore.utils.timers import add_observer, remove_observer

log = get_logger(__name__)

_SUMMARY = (
    ("rollout/accuracy", "acc", "{:.3f}"),
    ("rollout/response_len_mean", "len", "{:.1f}"),
    ("dynamic_sampling/kept_groups", "kept", "{:.0f}"),
    ("dynamic_sampling/rounds", "rounds", "{:.0f}"),
    ("loss/policy", "loss", "{:+.4f}"),
    ("actor/entropy", "ent", "{:.3f}"),
    ("actor/grad_norm", "gnorm", "{:.3f}"),
    ("time/step_s", "s", "{:.1f}"),
)


def summary_line(step: int, total: int, metrics: dict[str, float]) -> str:
    """`step` counts updates done (1..total), as metrics.jsonl, the plots, the saves and the stop messages do."""
    parts = [f"{label} {fmt.format(metrics[key])}" for key, label, fmt in _SUMMARY if key in metrics]
    return f"step {step}/{total} | " + " | ".join(parts)


# Seconds between two progress lines of a log without the live bar; 0 turns them off.
EVERY_ENV = "DAPO_PROGRESS_EVERY_S"
DEFAULT_EVERY_S = 120.0
# The phases (utils/timers.py: PhaseTimer's and phase_scope's names) in a progress line's words.
_PHASE_WORDS = {
    "generate": "generating",
    "reward": "scoring the answers",
    "summaries": "gathering the round's summaries",
    "exchange": "exchanging the step's samples",
    "old_logprobs": "computing the old log-probs",
    "update": "updating the actor",
    "weight_push": "pushing the weights to the engine",
    "save": "saving",
    "restore": "restoring",
    "step": "the step's end (the held-out check, when due)",
}
_IN_A_ROUND = ("generate", "reward", "summaries")
_note_observers: list[Callable[[str], None]] = []


def note(text: str) -> None:
    """A long part of a step says how far it is (the verifier pool's checks: minutes at a round of a slow
    verifier): the live bar shows it, a log without one puts it in its next progress line."""
    for observer in _note_observers:
        observer(text)


def every_s_from_env(environ=os.environ) -> float:
    """DAPO_PROGRESS_EVERY_S: seconds between progress lines (0: none); the default where unset or unreadable."""
    text = environ.get(EVERY_ENV, "").strip()
    if not text:
        return DEFAULT_EVERY_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value < 0 or value != value:
        log.warning("%s=%r is not a number of seconds (0 or more): progress lines every %g s", EVERY_ENV, text,
                    DEFAULT_EVERY_S)  # fmt: skip
        return DEFAULT_EVERY_S
    return value


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class RunProgress:
    """A live bar when enabled on a terminal (rank 0 with logging.progress), the per-step line always on rank 0's
    log, and, without the bar, a progress line at least every `every_s` during a step, a save or a restore (a
    thread; `poll` is its one call). A phase observer (utils/timers.py) and a note observer while entered."""

    def __init__(
        self,
        enabled: bool,
        total_steps: int,
        live: bool | None = None,
        every_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        thread: bool = True,  # False: the caller polls (a test's fake clock)
    ):
        self.total_steps = total_steps
        self.every_s = every_s_from_env() if every_s is None else every_s
        self._clock, self._polled_by_thread = clock, thread
        self._rounds = 0
        self._done = 0  # steps done
        self._lock = threading.Lock()
        self._phases: list[tuple[str, float]] = []  # (name, entered at), outermost first
        self._step_start: float | None = None  # from entering a step until its summary line
        self._after: tuple[str, float] | None = None  # the last phase left within the step, and when
        self._note: str | None = None  # the latest note of the innermost phase
        self._last_line = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._progress = None
        console = Console(stderr=True)
        if enabled and (console.is_terminal if live is None else live):
            self._progress = Progress(
                TextColumn("[bold]DAPO[/bold] {task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=console,
            )
            self._task = self._progress.add_task("step 1: generating", total=total_steps)

    @property
    def lines(self) -> bool:
        """Progress lines instead of the bar: no live bar, a log that shows INFO (rank 0's) and a period."""
        return self._progress is None and self.every_s > 0 and log.isEnabledFor(logging.INFO)

    def __enter__(self) -> RunProgress:
        _note_observers.append(self._on_note)
        add_observer(self)
        if self._progress is not None:
            self._progress.start()
        elif self.lines and self._polled_by_thread:
            self._stop.clear()
            self._thread = threading.Thread(target=self._beat, name="dapo-progress-lines", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        _note_observers.remove(self._on_note)
        remove_observer(self)
        if self._progress is not None:
            self._progress.stop()
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=5)
            self._thread = None

    def _beat(self) -> None:
        tick = max(0.05, min(5.0, self.every_s / 4))
        while not self._stop.wait(tick):
            self.poll()

    # ---- phase observer (utils/timers.py) ----------------------------------------------------------------------
    def enter(self, name: str) -> None:
        with self._lock:
            now = self._clock()
            if name == "step":
                self._step_start, self._after = now, None
                self._last_line = now  # the first line comes every_s into the step
            elif not self._phases:  # a save or a restore, outside a step
                self._last_line = now
            self._phases.append((name, now))
            self._note = None

    def exit(self, name: str) -> None:
        with self._lock:
            for i in range(len(self._phases) - 1, -1, -1):
                if self._phases[i][0] == name:
                    del self._phases[i:]
                    break
            self._after, self._note = (name, self._clock()), None

    # ---- lines ---------------------------------------------------------------------------------------------------
    def _on_note(self, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=f"step {self._done + 1}: {text}")
            return
        with self._lock:
            self._note = text
        self.poll()

    def poll(self) -> str | None:
        """Log a progress line when every_s has passed since the last (and a step, a save or a restore is under
        way); the line, or None."""
        if not self.lines:
            return None
        with self._lock:
            now = self._clock()
            if now - self._last_line < self.every_s or not (self._phases or self._step_start is not None):
                return None
            self._last_line = now
            line = self._line(now)
        log.info(line)
        return line

    def _line(self, now: float) -> str:
        inner = next((entry for entry in reversed(self._phases) if entry[0] != "step"), None)
        if inner is not None:
            name, since = inner
            # a save comes after its step's summary line: that step is done
            what = f"saving step {self._done}" if name == "save" else _PHASE_WORDS.get(name, name)
        elif self._after is not None:
            name, since = self._after
            what = f"after {_PHASE_WORDS.get(name, name)}" if name != "step" else _PHASE_WORDS["step"]
        else:
            name, since, what = "step", self._step_start or now, "starting"
        if name in _IN_A_ROUND:
            what += f" (round {self._rounds + 1})"
        what += f", {duration(now - since)} so far"
        if self._note:
            what += f": {self._note}"
        if self._step_start is None:  # a save or a restore
            return what
        return f"step {self._done + 1}/{self.total_steps}, {duration(now - self._step_start)} in: {what}"

    # ---- the bar and the summary ---------------------------------------------------------------------------------
    def resume_at(self, step: int) -> None:
        """A resumed run: `step` updates are done."""
        self._done = step
        if self._progress is not None:
            self._progress.update(self._task, completed=step, description=self._next(step))

    def round_done(self) -> None:
        self._rounds += 1
        if self._progress is not None:
            step = int(self._progress.tasks[0].completed) + 1
            self._progress.update(
                self._task, description=f"step {step}: generation round {self._rounds} done, training"
            )

    def step_done(self, step: int, metrics: dict[str, float]) -> None:
        with self._lock:
            self._rounds, self._done = 0, step
            self._step_start, self._after = None, None
        line = summary_line(step, self.total_steps, metrics)
        if self._progress is None:
            log.info(line)
            return
        self._progress.console.print(line, highlight=False, soft_wrap=True)
        self._progress.update(self._task, completed=step, description=self._next(step))

    def _next(self, done: int) -> str:
        return f"step {done + 1}: generating" if done < self.total_steps else f"{done} steps done"
