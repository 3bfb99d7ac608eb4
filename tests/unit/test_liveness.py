"""The peer watch's decisions (dapo_mcore/parallel/liveness.py) on a fake clock and an in-memory store, no
threads of its own: a counter that moves, one that stops, a rank that left, a store that stops answering.
tests/dist/test_liveness.py runs the real thing on 3 processes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from dapo_mcore.config import load_config
from dapo_mcore.config.key_docs import key_descriptions
from dapo_mcore.config.validate import config_problems
from dapo_mcore.parallel.liveness import (
    ACKS,
    LOST,
    PEER_LOST_EXIT_CODE,
    LastHeard,
    PeerWatch,
    StoreAnswers,
    beat_period,
    lost_rank_verdict,
    stop_line,
    store_lost_verdict,
)

TIMEOUT_S = 60.0
REPO = Path(__file__).resolve().parents[2]


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeStore:
    """The TCPStore calls the watch makes, on a dict (values as bytes, as the store returns them)."""

    def __init__(self):
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.data[key]

    def add(self, key: str, amount: int) -> int:
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def check(self, keys: list[str]) -> bool:
        return all(key in self.data for key in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.data[key] for key in keys]


class Rank:
    """One rank's watch on the shared fake store; `exits` records the exit codes it asked for."""

    def __init__(self, store: FakeStore, clock: FakeClock, rank: int, world_size: int = 3):
        self.exits: list[int] = []
        self.watch = PeerWatch(store, rank, world_size, TIMEOUT_S, "node0:29500", clock, self.exits.append)
        store.set(f"host/{rank}", f"node{rank}")
        store.add(f"beat/{rank}", 1)

    def beat(self) -> None:
        self.watch._beat()


@pytest.fixture
def lines():
    """The error lines the watch logs (its logger's own handler: the project's root logger may not propagate)."""
    seen: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("dapo_mcore.parallel.liveness")
    logger.addHandler(handler)
    yield seen
    logger.removeHandler(handler)


def test_beats_come_six_times_a_timeout_and_at_most_10_s_apart():
    assert beat_period(120.0) == 10.0
    assert beat_period(30.0) == 5.0


def test_a_counter_that_moves_is_heard_one_that_stops_is_silent_from_its_last_move():
    heard = LastHeard([1, 2], now=0.0)
    for t in range(0, 100, 10):
        heard.saw(1, t, now=float(t))  # moves every beat
        heard.saw(2, 7, now=float(t))  # stuck at 7 since t=0
    assert heard.silent(now=95.0, timeout_s=TIMEOUT_S) == [(2, 95.0)]
    assert heard.silent(now=59.0, timeout_s=TIMEOUT_S) == []


def test_a_rank_never_heard_counts_from_the_start_and_the_longest_silent_comes_first():
    heard = LastHeard([1, 2, 3], now=0.0)
    heard.saw(2, 1, now=5.0)
    heard.saw(3, 1, now=70.0)
    assert heard.silent(now=70.0, timeout_s=TIMEOUT_S) == [(1, 70.0), (2, 65.0)]


def test_a_rank_that_left_is_never_silent():
    heard = LastHeard([1, 2], now=0.0)
    heard.left(2)
    assert heard.ranks == [1]
    assert [rank for rank, _ in heard.silent(now=1000.0, timeout_s=TIMEOUT_S)] == [1]


def test_the_store_is_silent_once_no_call_has_answered_for_the_timeout():
    answers = StoreAnswers(now=0.0)
    answers.answered(now=30.0)
    assert answers.silent_for(now=89.0, timeout_s=TIMEOUT_S) is None
    assert answers.silent_for(now=90.0, timeout_s=TIMEOUT_S) == 60.0


def test_the_stop_line_names_the_rank_its_host_and_the_exit_code():
    line = stop_line(lost_rank_verdict(2, "node2", 31.4, judge=0))
    assert line == (
        "peer lost: rank 2 on host node2 last heard 31 s ago (judged by rank 0); stopping this rank (exit 76) so "
        "that the job can be resumed from its newest save"
    )
    assert "(and 7 more silent ranks)" in lost_rank_verdict(8, "node1", 60, judge=0, others=7)
    silent_store = store_lost_verdict("node0:29500", "node0", 61)
    assert silent_store.startswith("the store at node0:29500 (rank 0's host, node0) has not answered for 61 s")


def test_rank_0_hears_ranks_whose_counters_move_and_stops_nobody():
    store, clock = FakeStore(), FakeClock()
    ranks = [Rank(store, clock, r) for r in range(3)]
    for _ in range(20):  # 200 s of beats
        clock.now += 10.0
        for rank in ranks:
            rank.beat()
    assert all(not rank.exits for rank in ranks)
    assert LOST not in store.data


def test_rank_0_declares_a_silent_rank_lost_and_the_others_stop_on_its_verdict(lines):
    store, clock = FakeStore(), FakeClock()
    rank0, rank1, _rank2 = (Rank(store, clock, r) for r in range(3))
    store.add(ACKS, 1)  # rank 1 acknowledged the verdict (else rank 0 waits for it up to two periods)
    for _ in range(6):  # rank 2's node dies: its counter stays where rank 0 first read it (at the first beat)
        clock.now += 10.0
        rank0.beat()
        rank1.beat()
    assert not rank0.exits, "judged before the timeout"
    clock.now += 10.0
    rank0.beat()
    assert rank0.exits == [PEER_LOST_EXIT_CODE]
    verdict = "rank 2 on host node2 last heard 60 s ago (judged by rank 0)"
    assert store.get(LOST).decode() == verdict
    rank1.beat()
    assert rank1.exits == [PEER_LOST_EXIT_CODE]
    assert lines == [stop_line(verdict)] * 2
    assert int(store.get(ACKS)) == 2  # rank 1's ack added to the one above


def test_a_rank_that_left_is_not_declared_lost_however_long_it_is_silent():
    store, clock = FakeStore(), FakeClock()
    rank0, rank1, rank2 = (Rank(store, clock, r) for r in range(3))
    rank2.watch.leave()  # destroy_parallel: marks the rank as left (no threads were started here)
    for _ in range(30):  # 300 s: rank 1 still works, rank 2's process is long gone
        clock.now += 10.0
        rank0.beat()
        rank1.beat()
    assert rank0.exits == [] and rank1.exits == []
    assert LOST not in store.data


def test_the_other_ranks_declare_rank_0_lost_when_its_counter_stops():
    """Under torchrun the agent's store outlives a frozen rank 0: the others watch rank 0's counter."""
    store, clock = FakeStore(), FakeClock()
    _rank0, rank1 = Rank(store, clock, 0, world_size=2), Rank(store, clock, 1, world_size=2)
    for _ in range(7):
        clock.now += 10.0
        rank1.beat()
    assert rank1.exits == [PEER_LOST_EXIT_CODE]
    assert store.get(LOST).decode().startswith("rank 0 on host node0 last heard 6")


def test_a_store_that_has_not_answered_for_the_timeout_stops_the_rank_naming_it(lines):
    store, clock = FakeStore(), FakeClock()
    rank1 = Rank(store, clock, 1)
    rank1.watch._host0 = "node0"
    rank1.beat()
    clock.now += 59.0  # the beat thread sits in a call that never returns: only the clock moves
    rank1.watch._check_store()
    assert rank1.exits == []
    clock.now += 1.0
    rank1.watch._check_store()
    assert rank1.exits == [PEER_LOST_EXIT_CODE]
    assert lines == [stop_line("the store at node0:29500 (rank 0's host, node0) has not answered for 60 s: rank 0's "
                               "host is gone or frozen")]  # fmt: skip


def test_only_the_first_stop_speaks():
    store, clock = FakeStore(), FakeClock()
    rank1 = Rank(store, clock, 1)
    clock.now += 100.0
    rank1.watch._check_store()
    rank1.watch._check_store()
    assert rank1.exits == [PEER_LOST_EXIT_CODE]


@pytest.mark.parametrize(
    ("timeout_s", "refused"), [(120.0, False), (0.0, False), (5.0, False), (3.0, True), (-1.0, True)]
)
def test_peer_timeout_is_0_for_no_watch_or_at_least_5_s(timeout_s, refused):
    cfg = load_config(REPO / "examples/smoke_cpu.yaml", [f"parallel.peer_timeout_s={timeout_s}"])
    problems = [p for p in config_problems(cfg) if "peer_timeout_s" in p]
    assert bool(problems) == refused, problems
    assert "exit code 76" in key_descriptions()["parallel.peer_timeout_s"]


def test_a_log_stream_already_closed_does_not_keep_the_rank_from_stopping(lines, tmp_path):
    """Flushing the log before the exit met a handler whose stream was closed (a suite run: a handler left on a
    stream pytest had closed) and raised ValueError out of the stop: the rank would then have stayed in its
    collective."""
    closed = open(tmp_path / "log", "w")  # noqa: SIM115 - closed at once: the point
    closed.close()
    handler = logging.StreamHandler(closed)
    logger = logging.getLogger("dapo_mcore.parallel.liveness")
    logger.addHandler(handler)
    handler.emit = lambda record: None  # the line itself goes elsewhere; only the flush meets the closed stream
    try:
        rank1 = Rank(FakeStore(), clock := FakeClock(), 1)
        clock.now += 100.0
        rank1.watch._check_store()
    finally:
        logger.removeHandler(handler)
    assert rank1.exits == [PEER_LOST_EXIT_CODE]
