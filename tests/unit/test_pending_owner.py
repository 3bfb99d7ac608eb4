"""Partial rollout's pending groups stay with the engine replica that began them (rollout/pending.py): only
records cross ranks, each replica saves its own groups in a file of its own, and a save resumes at the same or
another number of replicas.

Samplers of several ranks run in threads (tests/unit/test_exchange.py ThreadWorld) on the long-tail engine of
tests/unit/test_partial_rollout.py, whose rounds stop with answers unfinished."""

import copy
import pickle

import pytest

from dapo_mcore.data.arithmetic import ArithmeticTask
from dapo_mcore.data.datasets import PromptStream
from dapo_mcore.rewards.pool import VerifierPool
from dapo_mcore.rollout.agreement import LocalBoard
from dapo_mcore.rollout.pending import PendingInfo, deal, file_name
from dapo_mcore.rollout.sampler import RolloutSampler, SamplerSettings
from dapo_mcore.utils.errors import CheckpointError
from dapo_mcore.utils.timers import PhaseTimer
from tests.helpers import FakeTokenizer, LongTailEngine
from tests.unit.test_exchange import ThreadWorld
from tests.unit.test_partial_rollout import SETTINGS, heavy_tail

PARTIAL = {**SETTINGS, "partial_rollout": True, "dynamic_sampling": False, "max_response_len": 120}


class ReplicaBoard(LocalBoard):
    """One replica's board (its TP ranks share it), its kept groups counted once per replica: each replica
    stops at its own share of the step's groups, so that a run does not depend on the threads' timing (the
    shared count of rollout/agreement.py does, by design)."""

    def __init__(self, replicas: int):
        super().__init__(wait_s=60)
        self.replicas = replicas

    def add(self, key, amount):
        return super().add(key, amount) * self.replicas


class World:
    """`size` thread-ranks of `size / engine_tp_size` engine replicas, each with its sampler."""

    def __init__(self, size: int, engine_tp_size: int = 1):
        self.threads, replicas = ThreadWorld(size), size // engine_tp_size
        boards = [ReplicaBoard(replicas) for _ in range(replicas)]
        self.samplers = [
            self._sampler(rank, size, engine_tp_size, boards[rank // engine_tp_size]) for rank in range(size)
        ]

    def _sampler(self, rank, size, engine_tp_size, board):
        world = self.threads
        return RolloutSampler(
            LongTailEngine(heavy_tail), FakeTokenizer(), PromptStream(ArithmeticTask(0, 99), seed=0),
            VerifierPool("dapo", workers=0).verify, SamplerSettings(**PARTIAL), rank=rank, world_size=size,
            all_gather=lambda obj: world.all_gather(rank, obj), engine_tp_size=engine_tp_size, board=board,
            exchange=lambda send, sizes, recv: world.all_to_all(rank, send, sizes, recv),
        )  # fmt: skip

    def each_rank(self, work):
        """work(rank, sampler) on every thread-rank at once; their results in rank order."""
        return self.threads.each_rank(lambda rank: work(rank, self.samplers[rank]))

    def steps(self, first, n):
        """Every rank's batches of steps first .. first + n - 1."""
        return self.each_rank(lambda _, s: [s.next_batch(step, PhaseTimer()) for step in range(first, first + n)])

    def save(self):
        """The run state (rank 0's, the same on every rank) and every rank's own files, as a save holds them."""
        files = {}
        for sampler in self.samplers:
            assert not set(sampler.own_files()) & set(files), "two ranks wrote the same file"
            files.update(copy.deepcopy(sampler.own_files()))
        return copy.deepcopy(self.samplers[0].state_dict()), files

    def load(self, state, files, step):
        """Every rank loads the save; returns the files each rank read."""
        reads = [[] for _ in self.samplers]

        def load(rank, sampler):
            def read(name):
                reads[rank].append(name)
                return copy.deepcopy(files[name])

            sampler.load_state_dict(copy.deepcopy(state), step, read=read)

        self.each_rank(load)
        return reads


def uids(groups):
    return sorted(g.prompt.uid for g in groups)


def batch_words(batch):
    """int32 words of a batch's held samples as the exchange sends them: each prompt once, tokens, log-probs."""
    held = [[s for s in g.samples if s.held] for g in batch.groups]
    return sum(len(ss[0].prompt_ids) + 2 * sum(len(s.response_ids) for s in ss) for ss in held if ss)


@pytest.mark.parametrize("size, engine_tp_size", [(2, 1), (4, 2)])
def test_pending_groups_stay_with_their_replica_and_only_records_cross_ranks(size, engine_tp_size):
    """Before, every pending group (tokens, log-probs, finished answers' text and routing) went to every rank
    each round: the exchange's words exceeded the batch's and each rank held every replica's groups."""
    world = World(size, engine_tp_size)
    batches = world.steps(0, 3)
    replicas = size // engine_tp_size
    for rank, sampler in enumerate(world.samplers):
        received = sum(batch_words(b) for b in batches[rank])
        assert world.threads.received_words[rank] == received  # the batches' tokens, no pending group's
        infos = sampler.pending.info
        assert len(infos) == replicas and infos == world.samplers[0].pending.info  # the same records everywhere
        assert [PendingInfo.of(g) for g in sampler.pending.own] == infos[rank // engine_tp_size]
    owned = [uids(world.samplers[r * engine_tp_size].pending.own) for r in range(replicas)]
    assert all(owned), "every replica should hold pending groups of its own"
    assert not set(owned[0]) & set(owned[1])
    for rank, sampler in enumerate(world.samplers):  # an engine replica's TP ranks hold the same groups
        assert uids(sampler.pending.own) == owned[rank // engine_tp_size]
    for sent in world.threads.sent_objects:  # the round summaries: a few numbers per answer, no text
        summaries, _ = sent
        assert all(not hasattr(s, "text") for g in summaries for s in g.samples)
        assert len(pickle.dumps(summaries)) < 700 * max(len(summaries), 1)


def test_each_replica_saves_its_own_groups_and_the_run_resumes_as_if_uninterrupted():
    reference, run = World(2), World(2)
    expected = reference.steps(0, 5)
    run.steps(0, 2)
    state, files = run.save()
    assert sorted(files) == [file_name(0, 2), file_name(1, 2)]
    assert "unfinished" not in state and len(pickle.dumps(state["pending"])) < 40 * (run.samplers[0].pending.total + 4)
    resumed = World(2)
    reads = resumed.load(state, files, step=2)
    assert reads == [[file_name(0, 2)], [file_name(1, 2)]]  # each replica reads its own file only
    for got, want in zip(resumed.steps(2, 3), expected):
        for a, b in zip(got, want[2:]):
            assert a.metrics == b.metrics
            assert [[s.response_ids.tolist() for s in g.samples if s.held] for g in a.groups] == [
                [s.response_ids.tolist() for s in g.samples if s.held] for g in b.groups
            ]


@pytest.mark.parametrize("saved_size, resumed_size", [(2, 1), (2, 4), (1, 2)])
def test_a_save_resumes_at_another_number_of_replicas_and_continues_every_pending_group(saved_size, resumed_size):
    run = World(saved_size)
    run.steps(0, 2)
    state, files = run.save()
    pending = sorted(uid for s in run.samplers for uid in uids(s.pending.own))
    resumed = World(resumed_size)
    reads = resumed.load(state, files, step=2)
    assert sorted(uid for s in resumed.samplers for uid in uids(s.pending.own)) == pending
    assert all(len(r) <= saved_size for r in reads) and sum(map(len, reads)) >= len(files)
    for rank, sampler in enumerate(resumed.samplers):
        assert [PendingInfo.of(g) for g in sampler.pending.own] == sampler.pending.info[rank]
    first = resumed.steps(2, 1)
    assert all(b[0].metrics["rollout/continued_answers"] > 0 for b in first[:1])


def test_a_pending_file_that_does_not_hold_what_the_records_list_is_refused():
    run = World(2)
    run.steps(0, 2)
    state, files = run.save()
    files[file_name(1, 2)] = files[file_name(1, 2)][:-1]
    with pytest.raises(
        CheckpointError, match=r"rollout_pending/replica_00001_of_00002.pt does not hold the \d+ groups"
    ):
        World(2).load(state, files, step=2)


def test_new_prompts_go_to_the_least_loaded_replica_first():
    assert deal([0, 0, 0], 5) == [0, 1, 2, 0, 1]  # nothing pending: the round-robin split
    assert deal([3, 0, 1], 4) == [1, 1, 2, 1]


def test_a_rounds_groups_come_back_with_the_replicas_pending_ones_interleaved_then_the_new_in_order():
    """A step's batch is taken from the front of this order: replica by replica, the first replica's pending groups
    filled it and its ranks sent most of its tokens (9.4 MB against 4.7 received by the worst rank of a
    4-process rehearsal)."""
    from dapo_mcore.rollout.pending import PendingGroups
    from dapo_mcore.rollout.placement import ReplicaSplit

    pending = PendingGroups(ReplicaSplit(rank=0, world_size=2, tp_size=1))
    pending.info = [[PendingInfo(0, 1, 5)] * 3, [PendingInfo(0, 1, 5)]]
    dealt = pending.deal_new(4)
    assert dealt == [1, 1, 0, 1]
    shares = [["a0", "a1", "a2", "new2"], ["b0", "new0", "new1", "new3"]]
    assert pending.in_order(shares, dealt) == ["a0", "b0", "a1", "a2", "new0", "new1", "new2", "new3"]
