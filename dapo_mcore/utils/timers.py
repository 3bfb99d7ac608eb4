"""Wall-clock time per named phase of an RL step (generate, reward, old_logprobs, update, weight_push)."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator


class PhaseTimer:
    def __init__(self, sync: Callable[[], None] | None = None):
        # `sync` (e.g. torch.cuda.synchronize) makes GPU phases end when their kernels end.
        self._sync = sync or (lambda: None)
        self._seconds: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
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
