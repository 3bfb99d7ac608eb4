"""A dead peer ends the job in bounded time: every surviving rank exits within about `parallel.peer_timeout_s`.

When a node dies (power, kernel panic, link down), TCP reports nothing to the ranks that talk to it: the
survivors sit in their next collective until the process group's timeout (parallel.timeout_minutes, 30; the
wait group's generation_timeout_minutes, 240) while the job burns its allocation. `PeerWatch` (started by
init_parallel when the world has more than one rank, left by destroy_parallel) turns that into one error line
naming the lost rank and its host, then exit code PEER_LOST_EXIT_CODE (76) on every rank:

- every period (min(10 s, timeout / 6)) each rank adds 1 to a counter of its own in the rendezvous store and
  checks (without waiting) whether a loss was declared;
- rank 0 reads every rank's counter (one multi_get) and notes by its OWN monotonic clock when each last moved:
  no clock agreement across hosts is needed. The other ranks watch rank 0's counter the same way (under
  torchrun the store is the agent's, which outlives a frozen rank 0);
- a rank whose counter has not moved for peer_timeout_s and that has not marked itself as left is lost: the
  judge writes the verdict ("rank R on host H last heard N s ago") to the store, and every rank that reads it
  stops. Rank 0 waits (two periods at most) until the others have read it before it stops, since its process
  may host the store (srun: rank 0 serves it);
- a second thread, which does no I/O, stops this rank when its own store calls have not answered for
  peer_timeout_s: a call to a vanished host blocks without end (TCPStore's client timeout does not cover it),
  so the store's host, rank 0's node, is gone. A store that refuses instead (its process ended: rank 0 left
  first under srun, or crashed, which the collectives report themselves) ends this rank's watch, not the rank;
- a clean end (destroy_parallel, or the interpreter's normal exit) marks the rank as left BEFORE the threads
  stop, so ranks that end at different times (rank 0 still saving while the others exited) are never judged
  lost. A rank that dies of an uncaught exception does not mark itself: the others stop on it as on a lost one.

"Stop" is one error line through the project's logger, then os._exit: the main thread is inside a C++
collective and nothing else interrupts it. The run is resumed from its newest save like any other failure.
A survivor exits at most about peer_timeout_s + 2 periods after the loss (rank 0 up to 2 periods later still,
while the others read the verdict).

The watch uses a store client of its own (MASTER_ADDR:MASTER_PORT, as init_process_group's env rendezvous),
so that a store call blocked on the main thread (a StoreBoard read) never blocks a beat, and keys of its own
(PREFIX). Cost: at 512 ranks and a 10 s period, about 150 small store operations a second (per rank and period:
the counter's add, the check for a verdict, a read of rank 0's counter) plus, on rank 0, one multi_get of 511
keys per period; nothing on the GPU or the collectives' network paths.

What it is not: heartbeats prove that a process lives, not that it progresses. A rank that is alive but hung
(a deadlock, a GPU that stopped answering) keeps beating; that is the collective timeout's job.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from dapo_mcore.utils.logging import get_logger
from dapo_mcore.utils.timers import add_observer, current_step, remove_observer

log = get_logger(__name__)

PEER_LOST_EXIT_CODE = 76


class StoreGone(RuntimeError):
    """The watch's store ended with this rank's launcher (PeerWatch._store_gone): no call is made to it."""


PREFIX = "dapo_mcore/peer_watch"
LOST = "lost"  # the verdict: "rank R on host H last heard N s ago (judged by rank J)"
ACKS = "acks"  # ranks that read the verdict (rank 0 waits for them before its process, maybe the store's, ends)
_generations = iter(range(1 << 30))  # a watch of a later world in this process (same store) uses fresh keys


def beat_period(timeout_s: float) -> float:
    """Seconds between two beats: six chances to be heard within the timeout, at most 10 s apart."""
    return min(10.0, timeout_s / 6)


def stop_line(verdict: str) -> str:
    return (
        f"peer lost: {verdict}; stopping this rank (exit {PEER_LOST_EXIT_CODE}) so that the job can be resumed "
        f"from its newest save"
    )


def lost_rank_verdict(rank: int, host: str, silent_s: float, judge: int, others: int = 0) -> str:
    more = f" (and {others} more silent rank{'s' if others > 1 else ''})" if others else ""
    return f"rank {rank} on host {host} last heard {silent_s:.0f} s ago{more} (judged by rank {judge})"


def store_lost_verdict(address: str, host0: str | None, silent_s: float) -> str:
    where = f"rank 0's host, {host0}" if host0 else "rank 0's host"
    return f"the store at {address} ({where}) has not answered for {silent_s:.0f} s: rank 0's host is gone or frozen"


class LastHeard:
    """When each watched rank's beat counter last moved, by this rank's own clock (`now`, monotonic)."""

    def __init__(self, ranks: list[int], now: float):
        self._count: dict[int, int | None] = dict.fromkeys(ranks)
        self._moved: dict[int, float] = dict.fromkeys(ranks, now)  # a rank not heard yet counts from the start

    @property
    def ranks(self) -> list[int]:
        return list(self._count)

    def saw(self, rank: int, count: int, now: float) -> None:
        if count != self._count[rank]:
            self._count[rank], self._moved[rank] = count, now

    def left(self, rank: int) -> None:
        """The rank ended cleanly: no longer watched."""
        self._count.pop(rank, None)
        self._moved.pop(rank, None)

    def silent(self, now: float, timeout_s: float) -> list[tuple[int, float]]:
        """(rank, seconds since its counter last moved) of each watched rank silent for timeout_s or longer,
        the longest silent first."""
        quiet = [(rank, now - moved) for rank, moved in self._moved.items() if now - moved >= timeout_s]
        return sorted(quiet, key=lambda rank_s: -rank_s[1])


class StoreAnswers:
    """When this rank's own store calls last succeeded, by its own clock: the store's host is presumed gone
    once they have not for the timeout."""

    def __init__(self, now: float):
        self._last = now

    def answered(self, now: float) -> None:
        self._last = now

    def silent_for(self, now: float, timeout_s: float) -> float | None:
        """Seconds without an answer when that is timeout_s or more, else None."""
        silent = now - self._last
        return silent if silent >= timeout_s else None


class PeerWatch:
    """The beat and clock threads of one rank (module docstring). `store`: a client of its own, keys under a
    prefix of their own; `clock` and `exit_process` are seams for the tests (a fake clock, no exit)."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timeout_s: float,
        store_address: str,
        clock: Callable[[], float] = time.monotonic,
        exit_process: Callable[[int], Any] = os._exit,
    ):
        self._store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self._address, self._clock, self._exit_process = store_address, clock, exit_process
        self.period = beat_period(timeout_s)
        self._telling_s = 2 * self.period + 2.0  # the longest a stopping rank spends telling the others
        watched = list(range(1, world_size)) if rank == 0 else [0]
        self._heard = LastHeard(watched, clock())
        self._answers = StoreAnswers(clock())
        self._present: set[int] = set()  # watched ranks whose counter exists (multi_get waits for missing keys)
        self._host0: str | None = socket.gethostname() if rank == 0 else None  # named when the store is silent
        self._done = threading.Event()
        self._stopping = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._pid = os.getpid()
        self._parent = os.getppid()
        # under torchrun the store is its agent's: it ends with the launcher, and this rank's parent is that launcher
        self._store_is_parents = "TORCHELASTIC_RUN_ID" in os.environ
        self.prefix = ""  # the store prefix of its keys (start_for_world): what gone_peer_line reads with

    @classmethod
    def start_for_world(cls, rank: int, world_size: int, timeout_s: float) -> PeerWatch | None:
        """A started watch over the store of init_process_group's env rendezvous (torchrun's or srun's
        MASTER_ADDR / MASTER_PORT), or None (with a warning) where there is none to reach."""
        import torch.distributed as dist

        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            log.warning("MASTER_ADDR / MASTER_PORT unset: no peer watch (parallel.peer_timeout_s has no effect)")
            return None
        client = dist.TCPStore(
            addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
        # a torchrun agent's store outlives a restart of the workers: each attempt's keys apart
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefix = f"{PREFIX}/{attempt}.{next(_generations)}"
        watch = cls(dist.PrefixStore(prefix, client), rank, world_size, timeout_s, f"{addr}:{port}")
        watch.prefix = prefix
        watch.start()
        return watch

    def start(self) -> None:
        self._call(self._store.set, f"host/{self.rank}", socket.gethostname())
        self._call(self._store.set, f"pid/{self.rank}", str(self._pid))
        add_observer(self)
        self._call(self._store.add, f"beat/{self.rank}", 1)
        if self._host0 is None:  # rank 0 publishes it now too (all ranks are in init_parallel): a short wait
            try:
                self._host0 = self._call(self._store.get, "host/0").decode()
            except Exception as err:  # noqa: BLE001 - the store's own timeout: the message names the address only
                log.debug("peer watch: rank 0's host unknown (%s)", err)
        for name, loop in (("beat", self._beat_loop), ("clock", self._clock_loop)):
            thread = threading.Thread(target=loop, name=f"peer-watch-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        atexit.register(self._at_exit)

    def leave(self) -> None:
        """A clean end: mark this rank as left, then stop the threads (in that order: never silent unmarked).
        While the mark is being written the clock thread still runs: a store that hangs still ends the rank."""
        if self._done.is_set():
            return
        try:
            self._call(self._store.set, f"left/{self.rank}", "1")
        except Exception as err:  # noqa: BLE001 - a store that refuses: its process ended (rank 0 left first)
            log.debug("peer watch: could not mark rank %d as left (%s)", self.rank, err)
        self.stop()

    def store_gone(self) -> bool:
        """Whether the store is known to have ended with this rank's launcher (torchrun killed: its ranks take
        that as SIGTERM and leave). Nobody is left to read a mark, and each call to the dead store printed a C++
        warning of 20 stack frames, twice with its reconnects, around the stop lines."""
        return self._store_is_parents and os.getppid() != self._parent

    def stop(self) -> None:
        self._done.set()
        remove_observer(self)
        atexit.unregister(self._at_exit)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=self.period + 1.0)

    def _at_exit(self) -> None:
        if os.getpid() != self._pid:  # a forked child exiting normally is not this rank leaving
            return
        if self._stopping.locked():  # a watch thread is stopping the rank: its exit code, not the main thread's
            time.sleep(self._telling_s + 1.0)  # (gloo: the main thread's collective failed as the others left)
            return
        if getattr(sys, "last_value", None) is not None:  # an uncaught exception: not a clean end
            self._done.set()
            return
        self.leave()

    # ---- the beat thread ----------------------------------------------------------------------------------
    def _beat_loop(self) -> None:
        while not self._done.wait(self.period):
            try:
                self._beat()
            except RuntimeError as err:  # torch's DistError: the store refused, its process ended (module docstring)
                if not self._done.is_set() and not isinstance(err, StoreGone):
                    log.warning(
                        "peer watch: the store at %s refused (%s): its process has ended (rank 0 left first, or "
                        "crashed); this rank's watch stops",
                        self._address,
                        str(err).splitlines()[0] if str(err) else type(err).__name__,
                    )
                self._done.set()
                return

    # ---- the phase this rank is in (a phase observer, utils/timers.py; published with the beats) ---------------
    def enter(self, name: str) -> None:
        """Published at once (about ten small store writes a step; TCPStore's client serialises its calls):
        what a survivor names if this rank's process is killed in this phase (gone_peer_line)."""
        if name == "step" or self._done.is_set():
            return
        try:
            self._call(self._store.set, f"where/{self.rank}", f"{name} at step {current_step()}")
        except Exception as err:  # noqa: BLE001 - the watch's own threads judge a store that fails
            log.debug("peer watch: could not publish the phase (%s)", err)

    def exit(self, name: str) -> None:
        pass

    def _beat(self) -> None:
        store = self._store
        self._call(store.add, f"beat/{self.rank}", 1)
        if self._call(store.check, [LOST]):
            self._stop_rank(self._call(store.get, LOST).decode(), tell_others=lambda: store.add(ACKS, 1))
            return
        if self.rank != 0 and self._host0 is None and self._call(store.check, ["host/0"]):
            self._host0 = self._call(store.get, "host/0").decode()
        now = self._clock()
        for rank, count in self._read_counts().items():
            self._heard.saw(rank, count, now)
        lost = []
        for rank, silent_s in self._heard.silent(now, self.timeout_s):
            if self._call(store.check, [f"left/{rank}"]):
                self._heard.left(rank)
            else:
                lost.append((rank, silent_s))
        if lost:
            rank, silent_s = lost[0]
            verdict = lost_rank_verdict(rank, self._host_of(rank), silent_s, self.rank, len(lost) - 1)
            readers = len(self._heard.ranks) - len(lost)

            def tell_others() -> None:
                store.set(LOST, verdict)
                if self.rank == 0:  # its process may host the store: the others read the verdict first
                    self._wait_for_acks(readers)

            self._stop_rank(verdict, tell_others)

    def _read_counts(self) -> dict[int, int]:
        for rank in self._heard.ranks:
            if rank not in self._present and self._call(self._store.check, [f"beat/{rank}"]):
                self._present.add(rank)
        ranks = [rank for rank in self._heard.ranks if rank in self._present]
        if not ranks:
            return {}
        values = self._call(self._store.multi_get, [f"beat/{rank}" for rank in ranks])
        return {rank: int(value) for rank, value in zip(ranks, values, strict=True)}

    def _host_of(self, rank: int) -> str:
        if self._call(self._store.check, [f"host/{rank}"]):
            return self._call(self._store.get, f"host/{rank}").decode()
        return "an unknown host (it never started its watch)"

    def _wait_for_acks(self, readers: int) -> None:
        deadline = self._clock() + 2 * self.period + 1.0
        while self._call(self._store.add, ACKS, 0) < readers and self._clock() < deadline:
            time.sleep(0.1)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if self.store_gone():
            self._done.set()  # the watch ends with the store (no rank is left to judge or to be judged)
            raise StoreGone(f"the store at {self._address} ended with this rank's launcher")
        result = fn(*args)
        self._answers.answered(self._clock())
        return result

    # ---- the clock thread (no I/O) ---------------------------------------------------------------------------
    def _clock_loop(self) -> None:
        while not self._done.wait(min(self.period, 1.0)):
            self._check_store()

    def _check_store(self) -> None:
        if self.store_gone():
            self._done.set()
            return
        silent_s = self._answers.silent_for(self._clock(), self.timeout_s)
        if silent_s is not None:
            self._stop_rank(store_lost_verdict(self._address, self._host0, silent_s))

    def _stop_rank(self, verdict: str, tell_others: Callable[[], Any] | None = None) -> None:
        """One error line, then `tell_others` (the verdict, or this rank's ack of it) for a bounded time (a store
        that hangs must not keep the rank alive), then the exit. Only the first thread to get here speaks."""
        if not self._stopping.acquire(blocking=False):
            return
        if self._done.is_set():  # the rank left (or its watch ended) meanwhile
            self._stopping.release()
            return
        log.error(stop_line(verdict))
        for flush in [handler.flush for handler in _handlers_of(log)] + [sys.stdout.flush, sys.stderr.flush]:
            with contextlib.suppress(ValueError, OSError):  # a closed or broken stream must not keep the rank alive
                flush()
        if tell_others is not None:
            teller = threading.Thread(target=_quietly, args=(tell_others,), name="peer-watch-tell", daemon=True)
            teller.start()
            teller.join(self._telling_s)
        self._done.set()
        self._exit_process(PEER_LOST_EXIT_CODE)


def gone_peer_line(watch: PeerWatch, connect_timeout_s: float = 3.0) -> str | None:
    """After a collective failed or the launcher stopped this rank: the line naming a rank of this host whose
    process is gone (the out-of-memory killer, kill -9, a crash), from what the ranks published in the store,
    for the first rank that asks ("" for the others); None when no rank of this host is gone (a rank on another
    host is found by that host's ranks) or the store cannot be reached within connect_timeout_s (its host is
    gone: the watch's own verdict covers that)."""
    import torch.distributed as dist

    if watch.store_gone():  # the launcher and its store ended: connecting printed c10d's stack traces, for nothing
        return None
    addr, port = watch._address.rsplit(":", 1)
    try:
        client = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=connect_timeout_s),
                               wait_for_workers=False)  # fmt: skip
        store, host = dist.PrefixStore(watch.prefix, client), socket.gethostname()
        for rank in range(watch.world_size):
            if rank == watch.rank or not store.check([f"pid/{rank}", f"host/{rank}"]):
                continue
            pid = int(store.get(f"pid/{rank}"))
            if store.get(f"host/{rank}").decode() != host or _process_lives(pid):
                continue
            if store.add("gone-reported", 1) != 1:  # another survivor says it: this one ends quietly
                return ""
            where = store.get(f"where/{rank}").decode() if store.check([f"where/{rank}"]) else "start-up"
            return (
                f"rank {rank} (pid {pid}) on host {host} ended during {where}, from outside this run (the "
                "out-of-memory killer, a kill -9 or a crash: the launcher's summary gives its exit code); every "
                "complete save is kept: continue with checkpoint.resume=auto"
            )
    except Exception as err:  # noqa: BLE001 - the store is gone or refuses: nothing to name from here
        log.debug("naming a gone rank: the store did not answer (%s)", err)
    return None


def _process_lives(pid: int) -> bool:
    """Whether a process of this host runs (a zombie, ended but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _quietly(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the store is gone too: the others' own watch ends them
        log.debug("peer watch: could not tell the other ranks (%s)", err)


def _handlers_of(logger: logging.Logger) -> list[logging.Handler]:
    handlers: list[logging.Handler] = []
    current: logging.Logger | None = logger
    while current is not None:
        handlers += current.handlers
        current = current.parent if current.propagate else None
    return handlers
