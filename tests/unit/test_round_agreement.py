"""Partial rollout over many replicas and engine TP ranks (rollout/agreement.py): the TP ranks of a replica take
their leader's verdicts and stop at the same engine step; every replica stops once the step's groups are kept
anywhere. Threads stand in for the ranks, sharing one board as the ranks share the process group's store; a
stand-in engine steps through answers of given lengths as an engine's step loop does (each step: the answers
that end are told to on_finished, then poll)."""

from __future__ import annotations

import threading
import time

import pytest

from dapo_mcore.data.types import Group, Prompt
from dapo_mcore.rewards.pool import Verdict
from dapo_mcore.rollout.agreement import AgreedVerify, LocalBoard, ReplicaRole, RoundControl
from dapo_mcore.rollout.base import Completion, step_poll
from dapo_mcore.rollout.partial import QuotaStopper, answer_requests, empty_answers


def step_loop(lengths: list[int], on_finished, step_s: float = 0.0) -> int:
    """Engine steps until every answer ended or the round was stopped; returns the steps run."""
    poll, ended, step = step_poll(on_finished), [False] * len(lengths), 0
    while not all(ended):
        step += 1
        time.sleep(step_s)
        stop = False
        for i, length in enumerate(lengths):
            if not ended[i] and length == step:
                ended[i] = True
                stop = stop or bool(on_finished(i, Completion([7] * length, [0.0] * length, "stop", f"answer {i}")))
        if stop or poll():
            return step
    return step


def groups_of(n_groups: int, n_answers: int) -> list[Group]:
    return [Group(Prompt(f"p{g}", "1"), empty_answers([1, 2], n_answers, step=0)) for g in range(n_groups)]


def replica_round(lengths, judge, board, role, wanted, step_s=0.001) -> tuple[int, RoundControl]:
    groups = groups_of(len(lengths) // 2, 2)
    _, slots = answer_requests(groups, max_response_len=10_000, seed=0)
    control = RoundControl(QuotaStopper(groups, slots, wanted, judge, 0), board, role, "round/0/0", wanted)
    return step_loop(lengths, control, step_s), control


def run_ranks(target, n: int) -> list:
    results, threads = [None] * n, []
    for i in range(n):
        threads.append(threading.Thread(target=lambda i=i: results.__setitem__(i, target(i)), daemon=True))
        threads[-1].start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results


def test_every_replica_stops_once_the_step_has_its_groups_even_one_with_no_informative_group():
    """8 replicas; 7 keep every group within 30 steps, the 8th keeps none and its answers run 2000 steps. Each
    replica stopped at its own share (ceil(wanted / 8) kept groups), so the 8th ran its whole long tail while
    every other replica waited for it; now it stops at a poll soon after the count reached the step's need."""
    board, wanted = LocalBoard(wait_s=30), 8

    def replica(r: int):
        informative = r < 7
        lengths = [5 + 3 * i for i in range(8)] if informative else [2000] * 8
        return replica_round(lengths, lambda group: informative, board, ReplicaRole(r), wanted)

    results = run_ranks(replica, 8)
    steps = [s for s, _ in results]
    assert steps[7] < 200, steps  # not its 2000-step tail
    assert sum(len(control.stopper.kept) for _, control in results) >= wanted
    results[0][1].forget()
    assert "round/0/0/kept" not in board.values


def test_a_replica_alone_stops_at_the_answer_that_completes_the_count():
    board = LocalBoard()
    steps, control = replica_round([3, 3, 5, 5, 9, 9, 50, 50], lambda group: True, board, ReplicaRole(0), 2, 0.0)
    assert steps == 5 and control.stopper.kept == {0, 1}


def test_the_tp_ranks_of_a_replica_take_the_leaders_verdicts_and_stop_at_the_same_step():
    """Engine TP 2: the peer's verifier times out on an answer the leader's passes. Each rank judged with its
    own pool, so the two disagreed on the stop: the one that left the engine loop left its peer waiting
    forever in the engine's TP all-reduce. Now the peer reads the leader's verdicts and its stop decisions."""
    board = LocalBoard(wait_s=30)
    own_verdict = {0: Verdict(True), 1: Verdict(False, timed_out=True)}  # what each rank's pool would say
    asked = {0: 0, 1: 0}

    def rank(tp_rank: int) -> int:
        role = ReplicaRole(replica=0, tp_rank=tp_rank, tp_size=2)

        def pool(pairs):
            asked[tp_rank] += len(pairs)
            return [own_verdict[tp_rank]] * len(pairs)

        verify = AgreedVerify(pool, board, role)

        def judge(group: Group) -> bool:
            verdicts = verify([(s.response_text, group.prompt.answer) for s in group.samples])
            return all(v.correct for v in verdicts)

        lengths = [4, 4, 6, 6, 30, 30, 500, 500]
        steps, _ = replica_round(lengths, judge, board, role, wanted=3)
        return steps

    steps = run_ranks(rank, 2)
    assert steps[0] == steps[1] and steps[0] < 500, steps  # the same step, at the leader's news of 3 kept
    assert asked == {0: 6, 1: 0}  # the peer verified nothing itself
    assert not any(key.startswith("verdicts/") for key in board.values)  # each read by its last reader, deleted


def test_a_peer_waits_for_its_leader_no_longer_than_the_board_allows():
    role = ReplicaRole(replica=0, tp_rank=1, tp_size=2)
    with pytest.raises(TimeoutError, match="no value for 'verdicts/0/0'"):
        AgreedVerify(lambda pairs: [], LocalBoard(wait_s=0.05), role)([("a", "b")])
