"""Megatron-Core's checkpoint writer forks a process per write bucket; a run SIGKILLed during a save left them
blocked for good on their results queue (seen as two processes left by tests/faults/test_signals.py's SIGKILL
case: the forked writer, `python -m tests.warm_cli`, and multiprocessing's resource tracker). After
CheckpointManager is made, each forked writer asks to be killed with the process that forked it."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import signal
from functools import partial

PR_GET_PDEATHSIG = 2


def parent_death_signal(*_args, results_queue, **_kwargs) -> None:
    """Stands in for the writer's work in the forked child: reports the signal its parent's death sends it."""
    value = ctypes.c_int(0)
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0)
    results_queue.put(value.value)


def forked_writer_signal() -> int:
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    ctx = mp.get_context("fork")  # as write_preloaded_data_multiproc forks its writers
    results = ctx.Queue()
    process = ctx.Process(target=partial(FileSystemWriterAsync.write_preloaded_data, []), kwargs={
        "results_queue": results})  # fmt: skip
    process.start()
    process.join(timeout=30)
    return results.get(timeout=5)


def test_megatrons_forked_checkpoint_writers_die_with_their_parent(monkeypatch):
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from dapo_mcore.checkpoint import writer_processes

    monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data", staticmethod(parent_death_signal))
    assert forked_writer_signal() == 0  # Megatron's own: nothing asked
    writer_processes.forked_writers_die_with_us()
    writer_processes.forked_writers_die_with_us()  # once is enough: not wrapped twice
    assert FileSystemWriterAsync.write_preloaded_data.__wrapped__ is parent_death_signal
    assert forked_writer_signal() == signal.SIGKILL


def _orphaned_before_asking() -> None:
    from dapo_mcore.utils import processes

    processes.os.getppid = lambda: 1  # as when the parent died before the child asked for its death signal
    processes.die_with_parent()
    processes.os._exit(0)  # reached only when die_with_parent let an orphan go on


def test_a_worker_whose_parent_died_before_it_asked_ends_at_once():
    """A verifier worker set its parent-death signal only once started; a run killed in that instant left it
    running until its pipe closed."""
    import multiprocessing as mp

    child = mp.get_context("fork").Process(target=_orphaned_before_asking)
    child.start()
    child.join(timeout=30)
    assert child.exitcode == 1
