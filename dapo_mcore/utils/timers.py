"""Wall-clock time per named phase of an RL step (generate, reward, exchange, old_logprobs, update,
weight_push), and the hook through which a rehearsal (dapo_mcore/rehearse) measures each phase.

Phase observers: `observing(observer)` installs an object with `enter(name)` and `exit(name)`, called around
every PhaseTimer phase and every `phase_scope` (the step, a save, a restore), outermost first. Nothing is
installed in a training run: then a phase costs two perf_counter calls, as before.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Protocol


class PhaseObserver(Protocol):
    def enter(self, name: str) -> None: ...

    def exit(self, name: str) -> None: ...


_observers: list[PhaseObserver] = []
_step = [0]  # the step (updates done + 1) the run is in: what a phase is named with in a rank's lost-peer line


def add_observer(observer: PhaseObserver) -> None:
    _observers.append(observer)


def remove_observer(observer: PhaseObserver) -> None:
    if observer in _observers:
        _observers.remove(observer)


@contextlib.contextmanager
def observing(observer: PhaseObserver) -> Iterator[None]:
    """Call `observer` around every phase while inside."""
    add_observer(observer)
    try:
        yield
    finally:
        remove_observer(observer)


def note_step(step: int) -> None:
    """The step the run is in now (the trainer, before each)."""
    _step[0] = step


def current_step() -> int:
    return _step[0]


@contextlib.contextmanager
def phase_scope(name: str) -> Iterator[None]:
    """A named part of the run that observers see (no time is recorded): the step, a save, a restore."""
    for observer in _observers:
        observer.enter(name)
    try:
        yield
    finally:
        for observer in reversed(_observers):
            observer.exit(name)


class PhaseTimer:
    def __init__(self, sync: Callable[[], None] | None = None):
        # `sync` (e.g. torch.cuda.synchronize) makes GPU phases end when their kernels end.
        self._sync = sync or (lambda: None)
        self._seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        with phase_scope(name):  # outside the timed part: what an observer does is not the phase's time
            self._sync()
            start = time.perf_counter()
            try:
                yield
            finally:
                self._sync()
                self._seconds[name] += time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        """Seconds per phase since the last pop, keyed 'time/<phase>_s'."""
        out = {f"time/{name}_s": secs for name, secs in self._seconds.items()}
        self._seconds.clear()
        return out
