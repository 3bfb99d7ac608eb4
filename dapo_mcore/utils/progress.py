"""What a person watching a run sees: a bar over RL steps (rank 0) and one summary line per step."""

from __future__ import annotations

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


# A log without the live bar (a task's log file) gets a long part's progress at most this often.
NOTE_EVERY_S = 60.0
_note_observers: list[Callable[[str], None]] = []


def note(text: str) -> None:
    """A long part of a step says how far it is (the verifier pool's checks: minutes at a round of a slow
    verifier): the live bar shows it, a log without one gets it at most every NOTE_EVERY_S."""
    for observer in _note_observers:
        observer(text)


class RunProgress:
    """A live bar when enabled (rank 0 with logging.progress), the per-step line always on rank 0's log, and the
    notes of long parts of a step (`note`) while it is entered."""

    def __init__(self, enabled: bool, total_steps: int):
        self.total_steps = total_steps
        self._rounds = 0
        self._done = 0  # steps done
        self._last_note = float("-inf")
        self._progress = None
        if enabled:
            self._progress = Progress(
                TextColumn("[bold]DAPO[/bold] {task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
            )
            self._task = self._progress.add_task("step 1: generating", total=total_steps)

    def __enter__(self) -> RunProgress:
        _note_observers.append(self._on_note)
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        _note_observers.remove(self._on_note)
        if self._progress is not None:
            self._progress.stop()

    def _on_note(self, text: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, description=f"step {self._done + 1}: {text}")
        elif time.monotonic() - self._last_note >= NOTE_EVERY_S:
            self._last_note = time.monotonic()
            log.info("step %d: %s", self._done + 1, text)

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
        self._rounds, self._done = 0, step
        line = summary_line(step, self.total_steps, metrics)
        if self._progress is None:
            log.info(line)
            return
        self._progress.console.print(line, highlight=False, soft_wrap=True)
        self._progress.update(self._task, completed=step, description=self._next(step))

    def _next(self, done: int) -> str:
        return f"step {done + 1}: generating" if done < self.total_steps else f"{done} steps done"
