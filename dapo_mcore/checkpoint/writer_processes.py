"""The processes behind Megatron-Core's checkpoint writes (its write-results manager, its forked writers per write
bucket), made to die with the run: a run killed outright (SIGKILL) left them blocked for good."""

from __future__ import annotations

import functools
import pickle
from typing import Any

from dapo_mcore.utils.processes import die_with_parent

_WRITER_MANAGER = None  # the multiprocessing manager behind Megatron's write-results queue, kept alive


def writer_results_queue_dies_with_us() -> None:
    """Megatron-Core's checkpoint writer passes results through a queue served by a multiprocessing manager
    process it starts on first use; if this process is killed outright (SIGKILL) that manager lives on. Start
    it here instead, with the parent-death signal set, and hand Megatron its queue."""
    global _WRITER_MANAGER
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if _WRITER_MANAGER is not None or getattr(filesystem_async, "_results_queue", "missing") is not None:
        return  # already made (by us or by Megatron), or a Megatron without this queue
    _WRITER_MANAGER = SyncManager(ctx=mp.get_context("spawn"))
    _WRITER_MANAGER.start(initializer=die_with_parent)
    filesystem_async._results_queue = _QuietResultsQueue(_WRITER_MANAGER.Queue())


def forked_writers_die_with_us() -> None:
    """Megatron-Core's torch_dist writer forks one process per write bucket (FileSystemWriterAsync.
    write_preloaded_data_multiproc) and reads their results from a queue. A run killed outright (SIGKILL) during
    a save left them blocked for good flushing their results to that queue, with multiprocessing's resource
    tracker beside them: each forked writer now dies with the process that forked it (checked once more after
    asking, in case that process died in between)."""

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    original = FileSystemWriterAsync.write_preloaded_data
    if getattr(original, "dies_with_parent", False):
        return

    @functools.wraps(original)
    def write_preloaded_data(*args: Any, **kwargs: Any) -> Any:
        die_with_parent()  # (and ends at once if the parent died before it asked)
        return original(*args, **kwargs)

    write_preloaded_data.dies_with_parent = True
    FileSystemWriterAsync.write_preloaded_data = staticmethod(write_preloaded_data)


class _QuietResultsQueue:
    """The write-results queue's proxy, whose put (in Megatron's forked writer process) ends that process
    quietly when the manager behind the queue is gone: the run names the dead manager at the step boundary
    (_check_writers), and the writer's own 20-line traceback (EOFError) used to come first.

    Items go through the manager pickled (put) and come out unpickled (get, get_nowait): the manager holds bytes.
    Holding the items themselves, it unpickled Megatron's write results, torch.distributed.checkpoint's, and so
    imported torch: about 4 CPU-s at every process's first save (a conversion's whole run took 9)."""

    def __init__(self, proxy: Any):
        self._proxy = proxy

    def put(self, item: Any, *args: Any, **kwargs: Any) -> None:
        try:
            self._proxy.put(pickle.dumps(item), *args, **kwargs)
        except (EOFError, ConnectionError):  # BrokenPipe and ConnectionRefused are ConnectionErrors
            raise SystemExit(1) from None  # multiprocessing prints no traceback for SystemExit

    def get(self, *args: Any, **kwargs: Any) -> Any:
        return pickle.loads(self._proxy.get(*args, **kwargs))

    def get_nowait(self) -> Any:
        return pickle.loads(self._proxy.get_nowait())

    def __getattr__(self, name: str) -> Any:
        if name == "_proxy":  # unpickling looks up attributes before __init__ has set it
            raise AttributeError(name)
        return getattr(self._proxy, name)


def dead_writer_manager() -> Any:
    """The write-results manager's process if it died; None while it lives (or was never started)."""
    if _WRITER_MANAGER is not None and not _WRITER_MANAGER._process.is_alive():
        return _WRITER_MANAGER._process
    return None


def restart_writer_manager() -> None:
    """A new write-results manager in place of a dead one (its queue proxy is useless without it)."""
    global _WRITER_MANAGER
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    _WRITER_MANAGER = None
    filesystem_async._results_queue = None
    writer_results_queue_dies_with_us()
