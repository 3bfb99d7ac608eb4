"""What crosses ranks in a generation round: summaries for everyone, and each chosen sample's tokens once, to the
ranks that train it only, as tensors over one all-to-all.

Several samplers (one per rank) run in threads of this process against a stand-in for the collectives, so the
replica split, the summaries and the all-to-all run as they do under torchrun.
"""

import pickle
import threading
from dataclasses import fields

import pytest
import torch

from dapo_mcore.data.arithmetic import ArithmeticTask
from dapo_mcore.data.batching import DataParallelSplit
from dapo_mcore.data.datasets import PromptStream
from dapo_mcore.data.types import NO_EXPERT, Group, NotHere, Prompt, Sample, group_to_dict
from dapo_mcore.rewards.pool import VerifierPool
from dapo_mcore.rollout.agreement import LocalBoard
from dapo_mcore.rollout.exchange import EVERY_RANK, ExchangeRanks, fetch_groups, keep_routing_to_send, summarize
from dapo_mcore.rollout.sampler import RolloutSampler, SamplerSettings
from dapo_mcore.utils.timers import PhaseTimer
from tests.helpers import FakeTokenizer, ScriptedEngine, group_as_lists
from tests.unit.test_sampler import BASE

SETTINGS = {**BASE, "prompts_per_step": 6}  # 8 prompts a round: surplus to drop or carry
MINI_BATCH = 8  # 24 samples a step: 3 mini-batches


class ThreadWorld:
    """all_gather and all_to_all for `size` threads, one per rank; records what each rank sent and received."""

    def __init__(self, size: int):
        self.size, self.barrier, self.slots = size, threading.Barrier(size, timeout=30), [None] * size
        self.sent_objects, self.received_words = [], [0] * size

    def _gather(self, rank, value):
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def all_gather(self, rank, obj):
        self.sent_objects.append(obj)
        return self._gather(rank, obj)

    def each_rank(self, work):
        """work(rank) in a thread per rank, at once; their results in rank order (the first error raised, after
        the others are released from the barrier)."""
        results, errors = [None] * self.size, []

        def main(rank):
            try:
                results[rank] = work(rank)
            except BaseException as err:  # noqa: BLE001 - raised below
                errors.append(err)
                self.barrier.abort()

        threads = [threading.Thread(target=main, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results

    def all_to_all(self, rank, send, send_sizes, recv_sizes):
        assert send.dtype == torch.int32 and send.numel() == sum(send_sizes)
        pieces = self._gather(rank, send.split(send_sizes))
        received = [pieces[source][rank] for source in range(self.size)]
        assert [t.numel() for t in received] == recv_sizes  # the sizes both sides computed agree
        self.received_words[rank] += sum(recv_sizes)
        return torch.cat(received)


def correct_for_even_first_operand(text, j):
    a = int(text.removeprefix("What is ").split("+")[0])
    return a % 2 == 0 and j == 0  # groups with an odd first operand are all wrong: dropped


def make_sampler(
    rank, world_size, world: ThreadWorld | None, engine_tp_size=1, response_len=5, dp=None, board=None, **over
):
    """Rank `rank`'s sampler; `dp`: the actor's data-parallel size (ranks rank // (world / dp) share a DP rank),
    None: every rank takes every sample; `board`: the one the thread-ranks share, as ranks share the store."""
    kwargs = {} if board is None else {"board": board}
    if world is not None:
        kwargs["exchange"] = lambda send, sizes, recv: world.all_to_all(rank, send, sizes, recv)
    if dp is not None:
        split = DataParallelSplit(dp, micro_batch_size=2, max_tokens_per_micro_batch=0, packed=False, multiple=8)
        kwargs["dp_rank_of"] = [r // (world_size // dp) for r in range(world_size)]
        kwargs["trainers_of"] = lambda lengths: split.trainers(lengths, MINI_BATCH)
    return RolloutSampler(
        ScriptedEngine(correct_for_even_first_operand, length=response_len),
        FakeTokenizer(),
        PromptStream(ArithmeticTask(0, 9), seed=0),
        VerifierPool("dapo", workers=0).verify,
        SamplerSettings(**{**SETTINGS, **over}),
        rank=rank,
        world_size=world_size,
        all_gather=(lambda obj: world.all_gather(rank, obj)) if world is not None else (lambda obj: [obj]),
        engine_tp_size=engine_tp_size,
        **kwargs,
    )


def run_steps(world_size, engine_tp_size=1, steps=2, response_len=5, dp=None, **overrides):
    """Every rank's batches of `steps` steps, the world that carried them and the samplers."""
    world, board = ThreadWorld(world_size), LocalBoard(wait_s=60)
    samplers = [
        make_sampler(r, world_size, world, engine_tp_size, response_len, dp, board, **overrides)
        for r in range(world_size)
    ]
    batches = world.each_rank(lambda rank: [samplers[rank].next_batch(step, PhaseTimer()) for step in range(steps)])
    return batches, world, samplers


def as_plain(batch):
    return [group_to_dict(g) for g in batch.groups]


def metadata(sample: Sample) -> dict:
    tokens = ("prompt_ids", "response_ids", "rollout_logprobs")  # NotHere on ranks that do not train it
    return {f.name: getattr(sample, f.name) for f in fields(sample) if f.name not in tokens}


@pytest.mark.parametrize("world_size,engine_tp_size,dp", [(2, 1, 2), (4, 2, 2), (4, 2, 4), (3, 1, 3), (2, 1, None)])
@pytest.mark.parametrize("carry_surplus", [False, True])
def test_each_rank_holds_the_samples_it_trains_as_one_process_would(world_size, engine_tp_size, dp, carry_surplus):
    """Every sample is whole on the ranks of the DP rank that trains it, and only its count elsewhere; the
    metadata (rewards, advantages, versions) is everywhere; the carried groups are whole on every rank."""
    one = make_sampler(0, 1, None, carry_surplus=carry_surplus)
    expected = [one.next_batch(step, PhaseTimer()) for step in range(2)]
    batches, _, samplers = run_steps(world_size, engine_tp_size, dp=dp, carry_surplus=carry_surplus)
    split = DataParallelSplit(dp or 1, 2, 0, False, 8)
    for rank, rank_batches in enumerate(batches):
        my_dp = rank // (world_size // dp) if dp else 0
        for got, want in zip(rank_batches, expected):
            assert got.metrics == want.metrics
            want_samples = want.samples
            trainers = split.trainers([len(s.prompt_ids) + len(s.response_ids) for s in want_samples], MINI_BATCH)
            for sample, reference, trainer in zip(got.samples, want_samples, trainers):
                assert metadata(sample) == metadata(reference)
                assert len(sample.prompt_ids) == len(reference.prompt_ids)
                assert len(sample.response_ids) == len(reference.response_ids)
                if trainer == my_dp:
                    assert torch.equal(torch.as_tensor(sample.response_ids), torch.as_tensor(reference.response_ids))
                    assert torch.equal(torch.as_tensor(sample.prompt_ids), torch.as_tensor(reference.prompt_ids))
                    assert sample.rollout_logprobs.tolist() == torch.as_tensor(reference.rollout_logprobs).tolist()
                else:
                    assert isinstance(sample.response_ids, NotHere) and not sample.held
                    with pytest.raises(LookupError, match="data-parallel ranks that train it"):
                        sample.response_ids[0]
    assert all([group_as_lists(g) for g in s.carry] == [group_as_lists(g) for g in one.carry] for s in samplers)


def test_summaries_carry_no_tokens_and_each_rank_receives_only_its_share():
    """The summaries are a few numbers per answer; the all-to-all brings each rank its DP rank's samples and
    each of their prompts once, nothing of the other rank's share and nothing of the unkept groups."""
    batches, world, _ = run_steps(2, steps=1, response_len=400, dp=2)
    for sent in world.sent_objects:  # per-round summaries: a few numbers per answer, whatever its length
        assert len(pickle.dumps(sent)) < 700 * len(sent)  # one group's 4 x 400 tokens would take > 6 kB
    for rank, rank_batches in enumerate(batches):
        batch = rank_batches[0]
        mine = [[s for s in g.samples if s.held] for g in batch.groups]
        words = sum(len(ss[0].prompt_ids) + 2 * sum(len(s.response_ids) for s in ss) for ss in mine if ss)
        assert world.received_words[rank] == words  # tokens + log-probs of its samples, each prompt once
        assert 0 < sum(len(ss) for ss in mine) < len(batch.samples)
        held = next(s for ss in mine for s in ss)
        assert held.response_ids.dtype == torch.int32 and held.rollout_logprobs.dtype == torch.float32
        assert batch.metrics["dynamic_sampling/generated_groups"] > len(batch.groups)  # some groups never moved


def fetch_locally(groups, trainers=None):
    """fetch_groups of `groups` on one rank (the all-to-all is the identity there)."""
    summaries = [summarize(g, True, 0, (0, i)) for i, g in enumerate(groups)]
    trainers = trainers or [[EVERY_RANK] * len(g.samples) for g in groups]
    local = {(0, i): g for i, g in enumerate(groups)}
    return fetch_groups(summaries, trainers, local, ExchangeRanks(rank=0, engine_tp_size=1, dp_rank_of=(0,)), None)


def test_groups_come_back_bit_for_bit_with_their_scores():
    samples = [
        Sample([1, 2, 3], [7, 8], [-0.5, float("-1e-30")], "stop", correct=True, reward=1.0, policy_step=3),
        Sample([1, 2, 3], [70000, 9, 10, 11], [-1.25, -2.0, -3.0, -0.1], "length", reward=-1.5, trainable=False),
    ]
    groups = [Group(Prompt("p", "5", "u1"), samples), Group(Prompt("q", "6", "u2"), [Sample([4], [5], [-7.0], "stop")])]
    back = fetch_locally(groups)
    for got, want in zip(back, groups):
        assert got.prompt == want.prompt
        for a, b in zip(got.samples, want.samples):
            assert a.prompt_ids.tolist() == b.prompt_ids and a.response_ids.tolist() == b.response_ids
            assert a.rollout_logprobs.tolist() == torch.tensor(b.rollout_logprobs).tolist()
            for key in ("finish_reason", "correct", "timed_out", "reward", "length_penalty", "trainable"):
                assert getattr(a, key) == getattr(b, key)
            assert a.policy_step == b.policy_step


def test_routed_experts_cross_ranks_with_their_samples_as_uint8():
    """A mixture-of-experts engine's routing (uint8 [rows, layers, k]) moves in the same tensor, four values a
    word: odd counts, NO_EXPERT and a sample without routing (an aborted answer) keep their place."""
    routing = [torch.tensor([[[3, NO_EXPERT]], [[0, 7]]], dtype=torch.uint8), None, torch.arange(9, dtype=torch.uint8)]
    routing[2] = routing[2].view(3, 3, 1)  # 9 values: padded to a whole word
    samples = [
        Sample([1, 2], [5, 6] + [7] * i, [-0.5] * (2 + i), "stop", routed_experts=r) for i, r in enumerate(routing)
    ]
    groups = [Group(Prompt("p", "1", "u"), samples[:2]), Group(Prompt("q", "2", "v"), samples[2:])]
    back = [s for g in fetch_locally(groups) for s in g.samples]
    for got, want in zip(back, samples):
        assert got.response_ids.tolist() == want.response_ids
        if want.routed_experts is None:
            assert got.routed_experts is None
        else:
            assert got.routed_experts.dtype == torch.uint8 and torch.equal(got.routed_experts, want.routed_experts)


def test_routing_goes_only_to_the_ranks_that_train_its_sample():
    """Two DP ranks: each receives the routing of its own samples only (uint8, 4 values a word)."""
    rows = lambda n: torch.full((n + 1, 4, 2), 9, dtype=torch.uint8)  # noqa: E731 - prompt 2 + response n - 1
    samples = [Sample([1, 2], [3] * n, [-1.0] * n, "stop", routed_experts=rows(n)) for n in (3, 5, 6, 2)]
    groups = [Group(Prompt("p", "1"), samples)]
    summaries = [summarize(groups[0], True, 0, (0, 0))]
    trainers = [[0, 1, 1, 0]]
    world = ThreadWorld(2)
    results = [None, None]

    def rank_main(rank):
        ranks = ExchangeRanks(rank, engine_tp_size=2, dp_rank_of=(0, 1))  # one replica of engine TP 2
        results[rank] = fetch_groups(
            summaries, trainers, {(0, 0): groups[0]}, ranks, lambda s, a, b: world.all_to_all(rank, s, a, b)
        )

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rank, trained in ((0, (0, 3)), (1, (1, 2))):
        got = results[rank][0].samples
        assert [s.held for s in got] == [i in trained for i in range(4)]
        assert all(s.routed_experts is None for i, s in enumerate(got) if i not in trained)
        routing_bytes = sum(samples[i].routed_experts.numel() for i in trained)
        tokens = 2 + sum(2 * len(samples[i].response_ids) for i in trained)
        assert world.received_words[rank] == tokens + -(-routing_bytes // 4)


def test_each_engine_tp_rank_keeps_the_routing_of_the_groups_it_sends_only():
    """A replica's engine-TP ranks generate the same groups; each kept the whole round's routing (39 GB a rank at
    the 30B-A3B recipe's round). Now each keeps that of the groups it sends, and every trainer still gets all of
    its samples' routing."""
    rows = lambda n, v: torch.full((n + 1, 4, 2), v, dtype=torch.uint8)  # noqa: E731 - prompt 2 + response n - 1

    def round_groups():  # what each engine-TP rank of the replica generated: the same groups
        return {
            (0, g): Group(
                Prompt(f"p{g}", "1"),
                [Sample([1, 2], [3] * n, [-1.0] * n, "stop", routed_experts=rows(n, g)) for n in (3, 5)],
            )  # fmt: skip
            for g in range(4)
        }

    held = [round_groups(), round_groups()]
    summaries = [summarize(g, True, 0, key) for key, g in held[0].items()]
    for rank in (0, 1):
        keep_routing_to_send(held[rank], 0, ExchangeRanks(rank, engine_tp_size=2, dp_rank_of=(0, 1)))
    with_routing = [
        [key for key, g in held[rank].items() if g.samples[0].routed_experts is not None] for rank in (0, 1)
    ]
    assert with_routing == [[(0, 0), (0, 2)], [(0, 1), (0, 3)]]
    trainers = [[0, 1]] * 4  # each group's first answer to DP rank 0, its second to DP rank 1
    world, results = ThreadWorld(2), [None, None]

    def rank_main(rank):
        ranks = ExchangeRanks(rank, engine_tp_size=2, dp_rank_of=(0, 1))
        results[rank] = fetch_groups(
            summaries, trainers, held[rank], ranks, lambda s, a, b: world.all_to_all(rank, s, a, b)
        )

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for rank in (0, 1):
        for g, group in enumerate(results[rank]):
            assert torch.equal(group.samples[rank].routed_experts, rows(len(group.samples[rank].response_ids), g))


def test_a_sample_whose_log_probs_do_not_match_its_tokens_is_not_sent():
    """One log-prob short would shift every later sample of the message: refused where it is packed."""
    short = Sample([1, 2], [5, 6, 7], [-1.0, -1.0], "stop")
    with pytest.raises(ValueError, match="3 tokens, 2 log-probs .* summary says 3, 3 .*not sent"):
        fetch_locally([Group(Prompt("p", "1"), [short])])


def test_only_kept_groups_wait_for_the_exchange():
    """A round's unkept groups are dropped where they were generated, at once (most of a 3x round); nothing
    of the round is held after the step's batch is chosen."""
    s = make_sampler(0, 1, None, response_len=50)
    s._generate_round(0, 0, 8, PhaseTimer())
    kept = [g for g in s._local.values()]
    assert kept and all(0 < g.accuracy < 1 for g in kept) and len(kept) < 8
    s.next_batch(0, PhaseTimer())
    assert s._local == {}


def test_every_summary_field_is_copied_verbatim_or_converted_and_survives_the_round_trip():
    """The summary's fields are listed once (exchange.VERBATIM_FIELDS) and copied both ways: a field added to
    SampleSummary but to neither list, or missing from Sample, is caught here, not by a silently default value."""
    import dataclasses

    from dapo_mcore.data.types import Prompt, Sample
    from dapo_mcore.rollout import exchange

    converted = {"response_len", "version_runs", "routing_shape"}
    names = {f.name for f in dataclasses.fields(exchange.SampleSummary)}
    assert names == set(exchange.VERBATIM_FIELDS) | converted
    sample = Sample([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], "length", policy_step=7)
    values = {"correct": True, "timed_out": True, "verify_error": True, "length_penalty": -0.5, "reward": 0.25,
              "trainable": False, "routing_dropped": True, "verifier_reward": 0.75,
              "reward_parts": {"format": 1.0}}  # fmt: skip
    for name, value in values.items():
        setattr(sample, name, value)
    summary = exchange.summarize(exchange.Group(Prompt("p", "1"), [sample]), True, 0, (0, 0))
    back = exchange._hollow_group(summary).samples[0]
    for name in exchange.VERBATIM_FIELDS:
        assert getattr(back, name) == getattr(sample, name), name


class RoutedScripted(ScriptedEngine):
    """ScriptedEngine with routing (a byte of the prompt's first operand at every row), made only for the
    prompts this rank keeps (SamplingParams.keep_routing) and counted: what an engine-TP rank holds."""

    def __init__(self):
        super().__init__(correct_for_even_first_operand, length=5)
        self.made = 0

    def generate(self, prompt_ids, params):
        keep = params.keep_routing or (True,) * len(prompt_ids)
        groups = super().generate(prompt_ids, params)
        for ids, group, kept in zip(prompt_ids, groups, keep):
            operand = int("".join(chr(i) for i in ids).removeprefix("What is ").split("+")[0])
            for c in group if kept else ():
                c.routed_experts = torch.full((len(ids) + len(c.token_ids) - 1, 2, 2), operand, dtype=torch.uint8)
                self.made += 1
        return groups


def test_an_engine_tp_rank_never_holds_the_routing_of_groups_another_rank_sends():
    """At engine TP 2 each rank is asked for the routing of the groups it sends only, from the engine's output on
    (the round's routing on every engine-TP rank was 39 GB a rank at the 30B-A3B recipe); the summaries of each
    group come from its sender, and every trainer gets its samples' routing as one process would hold it."""
    world_size, tp = 4, 2
    world, board = ThreadWorld(world_size), LocalBoard(wait_s=60)
    samplers = [make_sampler(r, world_size, world, tp, dp=2, board=board) for r in range(world_size)]
    for sampler in samplers:
        sampler.engine = RoutedScripted()
    batches = world.each_rank(lambda rank: samplers[rank].next_batch(0, PhaseTimer()))
    one = make_sampler(0, 1, None)
    one.engine = RoutedScripted()
    answers = one.settings.n_samples_per_prompt
    made = [s.engine.made for s in samplers]
    generated = one.next_batch(0, PhaseTimer()).metrics["dynamic_sampling/generated_groups"]
    assert sum(made) == generated * answers  # each answer's routing made once over the whole world
    assert all(0 < m < generated * answers / 2 for m in made)  # each rank: a share of its replica's
    for batch in batches:
        held = [s for s in batch.samples if s.held]
        assert held and all(
            s.routed_experts is not None and s.routed_experts.shape[0] == len(s.prompt_ids) + len(s.response_ids) - 1
            for s in held
        )
