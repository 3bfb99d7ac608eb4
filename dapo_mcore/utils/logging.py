"""Rank-aware logging: rank 0 speaks at INFO, the other ranks only warn (their lines carry the rank)."""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator

_ROOT = "dapo_mcore"


def setup_logging(rank: int = 0, level: str = "INFO") -> None:
    root = logging.getLogger(_ROOT)
    root.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    tag = "" if rank == 0 else f"[rank {rank}] "
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {tag}%(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level if rank == 0 else "WARNING")
    root.propagate = False


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")


# What reading a Megatron-Core save raises that says nothing about it: Megatron's notes that Transformer Engine and
# Apex are missing (conversion and checks run on the CPU, without them by design; they warn on import) and
# deprecations inside its checkpoint loader.
_SAVE_READING_WARNINGS = (
    (UserWarning, r"(Transformer Engine and Apex|Apex) (are|is) not installed"),
    (FutureWarning, r"`load_state_dict` is deprecated"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
    (UserWarning, r"absl\.logging is not installed"),  # Megatron-Core 0.19 imports it on every run
)


@contextlib.contextmanager
def quiet_save_reading() -> Iterator[None]:
    """Around code that imports Megatron-Core to read a save off the training path (eval's conversion, check)."""
    with warnings.catch_warnings():
        for category, message in _SAVE_READING_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=category)
        yield


def release_leaked_logging_locks() -> int:
    """Release the logging locks this thread holds for good, and return how many it held.

    A signal's exception (a Ctrl-C's KeyboardInterrupt, a stop at once's Terminated) can land in a logging call
    between its lock's acquire and the `try` that releases it. That leaves logging's module lock, or a handler's
    lock, held by this thread, and every other thread's next log call then blocks. wandb's teardown waited on such
    a thread for ever, so a stopped run did not end. Call this only where no logging call of this thread can be
    under way: the run's shutdown."""
    locks = [logging._lock] + [ref().lock for ref in list(logging._handlerList) if ref() is not None]
    released = 0
    for lock in locks:
        while lock is not None and getattr(lock, "_is_owned", lambda: False)():
            lock.release()
            released += 1
    return released
