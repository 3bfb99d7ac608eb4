"""What crosses ranks in a generation round: summaries for everyone, tokens of the kept groups once, as tensors.

Several samplers (one per rank) run in threads of this process against a stand-in for the collectives, so the
replica split, the summaries and the tensor exchange run as they do under torchrun.
"""

import pickle
import threading

import pytest
import torch

from dapo_mcore.data.arithmetic import ArithmeticTask
from dapo_mcore.data.datasets import PromptStream
from dapo_mcore.data.types import Group, Prompt, Sample, group_to_dict
from dapo_mcore.rewards.pool import VerifierPool
from dapo_mcore.rollout.exchange import pack_groups, summarize, unpack_groups
from dapo_mcore.rollout.sampler import RolloutSampler, SamplerSettings
from dapo_mcore.utils.timers import PhaseTimer
from tests.helpers import FakeTokenizer, ScriptedEngine
from tests.unit.test_sampler import BASE

SETTINGS = {**BASE, "prompts_per_step": 6}  # 8 prompts a round: surplus to drop or carry


class ThreadWorld:
    """all_gather for `size` threads, one per rank; records what each rank sent."""

    def __init__(self, size: int):
        self.size, self.barrier, self.slots = size, threading.Barrier(size, timeout=30), [None] * size
        self.sent_objects, self.sent_tensors = [], []

    def _gather(self, rank, value):
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def all_gather(self, rank, obj):
        self.sent_objects.append(obj)
        return self._gather(rank, obj)

    def all_gather_padded(self, rank, tensor, length):
        self.sent_tensors.append(tensor)
        padded = torch.zeros(length, dtype=tensor.dtype)
        padded[: tensor.numel()] = tensor
        return self._gather(rank, padded)


def correct_for_even_first_operand(text, j):
    a = int(text.removeprefix("What is ").split("+")[0])
    return a % 2 == 0 and j == 0  # groups with an odd first operand are all wrong: dropped


def make_sampler(rank, world_size, world: ThreadWorld | None, engine_tp_size=1, response_len=5, **overrides):
    kwargs = {}
    if world is not None:
        kwargs = {
            "all_gather": lambda obj: world.all_gather(rank, obj),
            "all_gather_padded": lambda t, n: world.all_gather_padded(rank, t, n),
        }
    return RolloutSampler(
        ScriptedEngine(correct_for_even_first_operand, length=response_len),
        FakeTokenizer(),
        PromptStream(ArithmeticTask(0, 9), seed=0),
        VerifierPool("dapo", workers=0).verify,
        SamplerSettings(**{**SETTINGS, **overrides}),
        rank=rank,
        world_size=world_size,
        all_gather=kwargs.pop("all_gather", lambda obj: [obj]),
        engine_tp_size=engine_tp_size,
        **kwargs,
    )


def run_steps(world_size, engine_tp_size=1, steps=2, response_len=5, **overrides):
    """Every rank's batches of `steps` steps, and the world that carried them."""
    world = ThreadWorld(world_size)
    samplers = [
        make_sampler(r, world_size, world, engine_tp_size, response_len, **overrides) for r in range(world_size)
    ]
    batches, errors = [[] for _ in samplers], []

    def rank_main(rank):
        try:
            for step in range(steps):
                batches[rank].append(samplers[rank].next_batch(step, PhaseTimer()))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
            world.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return batches, world, samplers


def as_plain(batch):
    return [group_to_dict(g) for g in batch.groups]


@pytest.mark.parametrize("world_size,engine_tp_size", [(2, 1), (4, 2), (3, 1)])
@pytest.mark.parametrize("carry_surplus", [False, True])
def test_every_rank_trains_on_the_batch_one_process_would(world_size, engine_tp_size, carry_surplus):
    one = make_sampler(0, 1, None, carry_surplus=carry_surplus)
    expected = [one.next_batch(step, PhaseTimer()) for step in range(2)]
    batches, _, samplers = run_steps(world_size, engine_tp_size, carry_surplus=carry_surplus)
    for rank_batches in batches:
        for got, want in zip(rank_batches, expected):
            assert as_plain(got) == as_plain(want)
            assert {k: v for k, v in got.metrics.items()} == want.metrics
    assert all([group_to_dict(g) for g in s.carry] == [group_to_dict(g) for g in one.carry] for s in samplers)


def test_round_gathers_carry_no_tokens_and_only_kept_groups_move_as_tensors():
    batches, world, _ = run_steps(2, steps=1, response_len=400)
    for sent in world.sent_objects:  # per-round summaries: a few numbers per answer, whatever its length
        assert len(pickle.dumps(sent)) < 700 * len(sent)  # one group's 4 x 400 tokens would take > 6 kB
    batch = batches[0][0]
    kept_tokens = sum(len(s.prompt_ids) + 2 * len(s.response_ids) for g in batch.groups for s in g.samples)
    prompt_repeats = sum(len(g.samples[0].prompt_ids) * (len(g.samples) - 1) for g in batch.groups)
    assert sum(t.numel() for t in world.sent_tensors) == kept_tokens - prompt_repeats  # each prompt sent once
    assert all(t.dtype == torch.int32 for t in world.sent_tensors)
    sample = batch.groups[0].samples[0]
    assert isinstance(sample.response_ids, torch.Tensor) and isinstance(sample.rollout_logprobs, torch.Tensor)
    assert batch.metrics["dynamic_sampling/generated_groups"] > len(batch.groups)  # some groups never moved


def test_packed_groups_come_back_bit_for_bit_with_their_scores():
    samples = [
        Sample([1, 2, 3], [7, 8], [-0.5, float("-1e-30")], "stop", correct=True, reward=1.0, policy_step=3),
        Sample([1, 2, 3], [70000, 9, 10, 11], [-1.25, -2.0, -3.0, -0.1], "length", reward=-1.5, trainable=False),
    ]
    groups = [Group(Prompt("p", "5", "u1"), samples), Group(Prompt("q", "6", "u2"), [Sample([4], [5], [-7.0], "stop")])]
    summaries = [summarize(g, True, 0, (0, i)) for i, g in enumerate(groups)]
    payload = pack_groups(groups)
    assert payload.numel() == sum(s.payload_len for s in summaries)
    back = unpack_groups(summaries, payload)
    for got, want in zip(back, groups):
        assert got.prompt == want.prompt
        for a, b in zip(got.samples, want.samples):
            assert a.prompt_ids.tolist() == b.prompt_ids and a.response_ids.tolist() == b.response_ids
            assert a.rollout_logprobs.tolist() == torch.tensor(b.rollout_logprobs).tolist()
            for key in ("finish_reason", "correct", "timed_out", "reward", "length_penalty", "trainable"):
                assert getattr(a, key) == getattr(b, key)
            assert a.policy_step == b.policy_step


def test_routed_experts_cross_ranks_with_their_samples():
    """A mixture-of-experts engine's routing (int16 [rows, layers, k]) moves in the same tensor, two values a
    word: odd counts, -1 sentinels and a sample without routing (an aborted answer) keep their place."""
    routing = [torch.tensor([[[3, -1]], [[0, 7]]], dtype=torch.int16), None, torch.arange(9, dtype=torch.int16)]
    routing[2] = routing[2].view(3, 3, 1)  # odd count: padded to a whole word
    samples = [
        Sample([1, 2], [5, 6] + [7] * i, [-0.5] * (2 + i), "stop", routed_experts=r) for i, r in enumerate(routing)
    ]
    groups = [Group(Prompt("p", "1", "u"), samples[:2]), Group(Prompt("q", "2", "v"), samples[2:])]
    summaries = [summarize(g, True, 0, (0, i)) for i, g in enumerate(groups)]
    payload = pack_groups(groups)
    assert payload.numel() == sum(s.payload_len for s in summaries)
    back = [s for g in unpack_groups(summaries, payload) for s in g.samples]
    for got, want in zip(back, samples):
        assert got.response_ids.tolist() == want.response_ids
        if want.routed_experts is None:
            assert got.routed_experts is None
        else:
            assert got.routed_experts.dtype == torch.int16 and torch.equal(got.routed_experts, want.routed_experts)
