"""Partial rollout on many replicas of many ranks: one stop decision per replica, one stop for all replicas once
the step has its groups, and one set of verdicts per replica.

Why. A partial round stops early, and who decides matters at scale:
- the TP ranks of one engine replica run the same engine in lockstep (vLLM's TP all-reduce has no timeout);
  if each judged answers with its own verifier pool, a verdict that timed out on one rank and not on another
  made them disagree about the stop: one left the engine loop while its peers stepped on and waited forever;
- a replica that stopped only when it alone had its share of the step's groups (ceil(wanted / replicas)) ran
  its whole long tail when its prompts held no informative group, while every other replica waited for it.
So the replica's leader (its TP rank 0) verifies and its verdicts are read by its peers (`AgreedVerify`), the
replicas add their kept groups to one count on the process group's key-value store, and every `check_every`
engine steps the leader reads that count and publishes stop / go for that step, which its peers read
(`RoundControl`): every TP rank of every replica stops at an engine step its leader chose, as soon as the
step's groups are kept anywhere. No collective runs inside the engine loop; a replica alone (engine TP 1)
also stops at once when an answer's end completes the count.

Cost per rank at 512 GPUs: one store read (peers) or one add and one write (leaders) every `check_every`
engine steps, one read per verified group (peers), a few bytes each; the store keeps a round's keys until
the round's all-gather, then rank 0 deletes its count (read keys are deleted by their last reader).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Protocol

from dapo_mcore.rewards.pool import Check, Verdict
from dapo_mcore.rollout.base import Completion
from dapo_mcore.rollout.partial import QuotaStopper


class Board(Protocol):
    """Values shared between ranks without a collective (parallel.StoreBoard; LocalBoard in one process)."""

    def publish(self, key: str, value: bytes) -> None: ...

    def read(self, key: str) -> bytes: ...

    def add(self, key: str, amount: int) -> int: ...

    def delete(self, key: str) -> None: ...


class LocalBoard:
    """A Board for one process (a sampler built without a process group), or for threads standing in for the
    ranks of a test: a read waits up to `wait_s` for its key."""

    def __init__(self, wait_s: float = 0.0):
        self.values: dict[str, bytes | int] = {}
        self.changed = threading.Condition()  # threads standing in for ranks (tests) wait for each other's keys
        self.wait_s = wait_s

    def publish(self, key: str, value: bytes) -> None:
        with self.changed:
            self.values[key] = value
            self.changed.notify_all()

    def read(self, key: str) -> bytes:
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout=self.wait_s):
                raise TimeoutError(f"no value for {key!r} in {self.wait_s:g} s")
            return self.values[key]

    def add(self, key: str, amount: int) -> int:
        with self.changed:
            self.values[key] = self.values.get(key, 0) + amount
            return self.values[key]

    def delete(self, key: str) -> None:
        with self.changed:
            self.values.pop(key, None)


@dataclass(frozen=True)
class ReplicaRole:
    """Where a rank stands in its engine replica: replica `replica`, TP rank `tp_rank` of `tp_size`."""

    replica: int
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def leader(self) -> bool:
        return self.tp_rank == 0

    def read_once(self, board: Board, key: str) -> bytes:
        """A peer reads the leader's value; the replica's last peer to read it deletes it."""
        value = board.read(key)
        if board.add(f"{key}/readers", 1) == self.tp_size - 1:
            board.delete(key)
            board.delete(f"{key}/readers")
        return value


class AgreedVerify:
    """The sampler's verify, with every TP rank of a replica taking its leader's verdicts: the leader runs the
    verifier pool and publishes the verdicts of its n-th call; its peers, which make the same calls in the same
    order (they generate the same answers), read them instead of verifying. Engine TP 1: the pool itself."""

    def __init__(self, verify: Callable[[list[Check]], list[Verdict]], board: Board, role: ReplicaRole):
        self.verify, self.board, self.role = verify, board, role
        self.calls = 0

    def __call__(self, pairs: list[Check]) -> list[Verdict]:
        if self.role.tp_size == 1:
            return self.verify(pairs)
        key = f"verdicts/{self.role.replica}/{self.calls}"
        self.calls += 1
        if self.role.leader:
            verdicts = self.verify(pairs)
            self.board.publish(key, json.dumps([asdict(v) for v in verdicts]).encode())
            return verdicts
        return [Verdict(**fields) for fields in json.loads(self.role.read_once(self.board, key))]


class RoundControl:
    """on_finished (and poll) for one replica's share of a partial round: the stopper judges each group once
    its answers have all ended; the leader adds each kept group to the round's count over every replica; the
    round stops once that count reaches `wanted` (module doc)."""

    def __init__(
        self,
        stopper: QuotaStopper,
        board: Board,
        role: ReplicaRole,
        round_key: str,
        wanted: int,
        check_every: int = 8,
    ):
        self.stopper, self.board, self.role, self.wanted = stopper, board, role, wanted
        self.count_key, self.decision_key = f"{round_key}/kept", f"{round_key}/stop/{role.replica}"
        self.check_every, self.steps, self.total = check_every, 0, 0

    def __call__(self, index: int, completion: Completion) -> bool:
        kept_before = len(self.stopper.kept)
        self.stopper(index, completion)
        newly_kept = len(self.stopper.kept) - kept_before
        if self.role.leader and newly_kept:
            self.total = self.board.add(self.count_key, newly_kept)
        # alone in its replica, a rank may stop at once; TP peers stop together, at a poll
        return self.role.tp_size == 1 and self.total >= self.wanted

    def poll(self) -> bool:
        """After each engine step: every `check_every` steps, whether the round stops at this step (the same
        answer on every TP rank of the replica)."""
        self.steps += 1
        if self.steps % self.check_every:
            return False
        if not self.role.leader:
            return self.role.read_once(self.board, f"{self.decision_key}/{self.steps}") == b"1"
        self.total = self.board.add(self.count_key, 0)
        stop = self.total >= self.wanted
        if self.role.tp_size > 1:
            self.board.publish(f"{self.decision_key}/{self.steps}", b"1" if stop else b"0")
        return stop

    def forget(self) -> None:
        """Once every replica has left the round (after its all-gather), on one rank: the count goes."""
        self.board.delete(self.count_key)
