"""Partial rollout's pending groups (at least one answer unfinished when its round stopped), each held by the
engine replica that generated it.

The replica that began a group keeps its tokens, log-probs, text and routing, continues it at its next round
and, at a save, writes it to a file of its own. Every rank also knows one small record of every replica's
pending groups (`PendingInfo`: the weight version it was begun under, its answers begun and their tokens),
from the round's summaries; that is all that crosses ranks, and it is what the round sizes, the staleness
drops and the metrics are decided from, identically on every rank.

New prompts go to the replica with the fewest groups so far (the lowest index on ties): with nothing pending
that is the round-robin split of a synchronous round. A round's groups come back in one order on every rank:
the replicas' pending groups interleaved (each replica's first, then each one's second, ...: a step's batch,
taken from the front, then draws on every replica alike, and so does the sending of its tokens), then the new
prompts in the order they were taken.

Per rank at the paper's shape: its replica's pending groups only (total / replicas; an engine replica's TP ranks
each hold its copy, as they generate it), where each rank held every replica's before; a save writes each
replica's groups once (its first TP rank), where every save held and cloned them all in the common state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dapo_mcore.data.types import Group, group_to_dict
from dapo_mcore.rollout.exchange import GroupSummary
from dapo_mcore.rollout.placement import ReplicaSplit
from dapo_mcore.rollout.saved_groups import saved_groups
from dapo_mcore.utils.errors import CheckpointError

# A save's file of one replica's pending groups: "rollout_pending/replica_00003_of_00008.pt".
FILE_DIR = "rollout_pending"


def file_name(replica: int, replicas: int) -> str:
    return f"{FILE_DIR}/replica_{replica:05d}_of_{replicas:05d}.pt"


@dataclass(frozen=True)
class PendingInfo:
    """What every rank knows of a pending group another replica holds."""

    begun: int  # the weight version its oldest answer was begun under
    answers_begun: int  # answers with at least one token
    tokens: int  # response tokens so far

    @classmethod
    def of(cls, group: Group | GroupSummary) -> PendingInfo:
        lengths = [s.response_len for s in group.samples]
        return cls(min(s.policy_step for s in group.samples), sum(n > 0 for n in lengths), sum(lengths))


def deal(loads: Sequence[int], n: int) -> list[int]:
    """The replica of each of n new groups: the one with the least `loads` so far, the lowest on ties."""
    loads, replicas = list(loads), []
    for _ in range(n):
        least = min(range(len(loads)), key=loads.__getitem__)
        replicas.append(least)
        loads[least] += 1
    return replicas


class PendingGroups:
    def __init__(self, split: ReplicaSplit):
        self.split = split
        self.own: list[Group] = []  # this replica's pending groups, in its order
        self.info: list[list[PendingInfo]] = [[] for _ in range(split.n_replicas)]  # every replica's

    @property
    def total(self) -> int:
        return sum(map(len, self.info))

    def drop_stale(self, step: int, max_staleness: int) -> list[PendingInfo]:
        """Drop every replica's groups begun more than max_staleness weight versions before `step` (the same
        decision on every rank); returns their records."""
        stale = []
        for replica, infos in enumerate(self.info):
            fresh = [step - info.begun <= max_staleness for info in infos]
            stale += [info for info, keep in zip(infos, fresh) if not keep]
            self.info[replica] = [info for info, keep in zip(infos, fresh) if keep]
            if replica == self.split.replica:
                self.own = [group for group, keep in zip(self.own, fresh) if keep]
        return stale

    def deal_new(self, n: int) -> list[int]:
        """The replica of each of a round's n new prompts (least loaded first)."""
        return deal([len(infos) for infos in self.info], n)

    def round_inputs(self, new: Sequence[Group], dealt: Sequence[int]) -> list[Group]:
        """This replica's inputs of a round: its pending groups, then the new ones dealt to it."""
        return self.own + [g for g, replica in zip(new, dealt) if replica == self.split.replica]

    def in_order(self, per_replica: Sequence[Sequence[GroupSummary]], dealt: Sequence[int]) -> list[GroupSummary]:
        """A round's summaries (each replica's, for its round_inputs) in the one order every rank uses."""
        pending = [list(s[: len(infos)]) for s, infos in zip(per_replica, self.info)]
        new = [iter(s[len(infos) :]) for s, infos in zip(per_replica, self.info)]
        interleaved = [
            share[i] for i in range(max(map(len, pending), default=0)) for share in pending if i < len(share)
        ]
        return interleaved + [next(new[replica]) for replica in dealt]

    def replace(self, per_replica: Sequence[Sequence[GroupSummary]], own_unfinished: list[Group]) -> None:
        """After a round: every replica's unfinished groups (from its summaries, in its order) and this
        replica's own (in the same order)."""
        self.info = [[PendingInfo.of(g) for g in share if not g.finished] for share in per_replica]
        self.own = own_unfinished
        if len(self.own) != len(self.info[self.split.replica]):
            raise RuntimeError(
                f"partial rollout: replica {self.split.replica} holds {len(self.own)} pending groups, its "
                f"summaries say {len(self.info[self.split.replica])}"
            )

    # ----- saves ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The records of every replica's groups (the same on every rank): plain numbers."""
        return {
            "replicas": self.split.n_replicas,
            "info": [[[i.begun, i.answers_begun, i.tokens] for i in infos] for infos in self.info],
        }

    def own_files(self) -> dict[str, Any]:
        """The file this rank writes into a save: its replica's groups, written by the replica's first TP rank."""
        if not self.own or self.split.tp_rank != 0:
            return {}
        return {file_name(self.split.replica, self.split.n_replicas): [group_to_dict(g) for g in self.own]}

    def load_state_dict(
        self, state: dict[str, Any], read: Callable[[str], Any], step: int | None, vocab_size: int | None = None
    ) -> None:
        """From a save: at the same number of replicas each takes its own file back as it was; at another, the
        saved groups (replica by replica) are dealt anew over this run's replicas, each rank reading only the
        files that hold groups dealt to it."""
        saved = saved_records(state)

        def groups_of(replica: int) -> list[Group]:
            return replica_groups(saved, replica, read, step, vocab_size)

        me = self.split.replica
        if len(saved) == self.split.n_replicas:
            self.info, self.own = saved, groups_of(me) if saved[me] else []
            return
        flat = [(replica, i) for replica, infos in enumerate(saved) for i in range(len(infos))]
        dealt = deal([0] * self.split.n_replicas, len(flat))
        self.info = [[saved[r][i] for (r, i), d in zip(flat, dealt) if d == to] for to in range(len(self.info))]
        mine = [(r, i) for (r, i), d in zip(flat, dealt) if d == me]
        files = {r: groups_of(r) for r in sorted({r for r, _ in mine})}
        self.own = [files[r][i] for r, i in mine]

    def load_common(self, groups: list[Group]) -> None:
        """Saves made before the groups had owners: every rank held all of them; dealt over the replicas."""
        dealt = deal([0] * self.split.n_replicas, len(groups))
        self.info = [[PendingInfo.of(g) for g, d in zip(groups, dealt) if d == r] for r in range(len(self.info))]
        self.own = [g for g, d in zip(groups, dealt) if d == self.split.replica]


def saved_records(state: dict[str, Any]) -> list[list[PendingInfo]]:
    """Every replica's records of a save's pending groups (PendingGroups.state_dict), checked as the run wrote them."""
    try:
        saved = [[PendingInfo(*map(int, i)) for i in infos] for infos in state["info"]]
        replicas = int(state["replicas"])
    except (TypeError, ValueError, KeyError) as err:
        raise CheckpointError(
            f"the save's partial-rollout records are not what the run wrote: {type(err).__name__}: {err}"
        ) from None
    if len(saved) != replicas:
        raise CheckpointError(f"the save's partial-rollout records list {len(saved)} of {replicas} replicas")
    return saved


def replica_groups(
    saved: list[list[PendingInfo]],
    replica: int,
    read: Callable[[str], Any],
    step: int | None,
    vocab_size: int | None = None,
) -> list[Group]:
    """The pending groups of one replica from its file of the save (`read`: the file by name), checked as the
    run wrote them and against the records every rank holds (`saved`: saved_records)."""
    name = file_name(replica, len(saved))
    groups = saved_groups(read(name), "unfinished", step, file=name, vocab_size=vocab_size)
    if [PendingInfo.of(g) for g in groups] != saved[replica]:
        raise CheckpointError(f"the save's {name} does not hold the {len(saved[replica])} groups it lists")
    return groups


def listed_files(state: dict[str, Any]) -> dict[str, str]:
    """The files a save's pending records (PendingGroups.state_dict) say it holds, each with what it holds
    ("2 unfinished groups of engine replica 0"): a replica's file is written only when it holds some."""
    saved = saved_records(state)
    return {
        file_name(replica, len(saved)): f"{len(infos)} unfinished group{'s' * (len(infos) != 1)} of engine replica "
        f"{replica}"
        for replica, infos in enumerate(saved)
        if infos
    }


def check_saved_files(
    state: dict[str, Any], read: Callable[[str], Any], step: int | None, vocab_size: int | None = None
) -> None:
    """Every replica's file of a save's pending groups, read and checked as the rank that resumes it reads its own
    (a resume reads only its replica's; `dapo-mcore check` reads them all, on one machine)."""
    saved = saved_records(state)
    for replica, infos in enumerate(saved):
        if infos:
            replica_groups(saved, replica, read, step, vocab_size)
