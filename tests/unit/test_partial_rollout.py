"""Partial rollout in the sampler (rollout.partial_rollout): a round stops once the step has its groups, the
unfinished answers are continued first at the next step by the new weights (each token tagged with the
weights that generated it), groups are scored only when whole, stale groups are dropped, and the buffer is
part of the sampler's saved state. The engine is tests.helpers.LongTailEngine: one token per answer per
decode step, lengths fixed by each answer's first token."""

import copy

import pytest

from dapo_mcore.data.arithmetic import ArithmeticTask
from dapo_mcore.data.datasets import PromptStream
from dapo_mcore.rewards.pool import VerifierPool
from dapo_mcore.rollout.guard import GuardedEngine
from dapo_mcore.rollout.sampler import RolloutSampler, SamplerSettings
from dapo_mcore.utils.seeding import derive_seed
from dapo_mcore.utils.timers import PhaseTimer
from tests.helpers import FakeTokenizer, LongTailEngine

MAX_LEN = 64
SETTINGS = dict(
    n_samples_per_prompt=4,
    prompts_per_step=4,
    gen_prompts_per_round=8,
    temperature=1.0,
    top_p=1.0,
    max_response_len=MAX_LEN,
    seed=0,
    overlong_buffer_len=4,
    max_rounds=4,
)


def heavy_tail(prompt_text: str, seed: int) -> tuple[int, bool]:
    """Most answers take 4-11 tokens, one in eight 40-79 (past MAX_LEN: cut); correct when the seed is even."""
    draw = derive_seed(7, prompt_text, seed)
    length = 40 + draw % 40 if draw % 8 == 0 else 4 + draw % 8
    return length, seed % 2 == 0


def make(partial=True, **overrides):
    engine = LongTailEngine(heavy_tail)
    settings = SamplerSettings(**{**SETTINGS, "partial_rollout": partial, **overrides})
    sampler = RolloutSampler(
        engine, FakeTokenizer(), PromptStream(ArithmeticTask(0, 99), seed=0), VerifierPool("dapo", workers=0).verify,
        settings, rank=0, world_size=1, all_gather=lambda obj: [obj],
    )  # fmt: skip
    return sampler, engine


def steps(sampler, n, first=0):
    return [sampler.next_batch(step, PhaseTimer()) for step in range(first, first + n)]


def check_tags(batch, step, max_staleness):
    for group in batch.groups:
        assert all(s.finished for s in group.samples)
        for s in group.samples:
            runs = s.token_versions()
            assert sum(n for _, n in runs) == s.response_len == len(s.rollout_logprobs)
            versions = [v for v, _ in runs]
            assert versions == sorted(versions) and versions[0] == s.policy_step
            assert all(step - max_staleness <= v <= step for v in versions)


def test_a_round_stops_once_the_step_has_its_groups_and_the_rest_waits():
    sync, sync_engine = make(partial=False, dynamic_sampling=False)
    part, engine = make(dynamic_sampling=False)
    first = part.next_batch(0, PhaseTimer())
    sync.next_batch(0, PhaseTimer())
    assert len(first.groups) == 4 and first.metrics["rollout/unfinished_groups"] > 0
    # the synchronous round ran until its longest answer; this one stopped at the 4th whole group
    assert engine.decode_steps < sync_engine.decode_steps
    assert first.metrics["rollout/slot_utilization"] > 0 and part.pending.own
    pending = [s for g in part.pending.own for s in g.samples if not s.finished]
    assert pending and all(s.finish_reason == "abort" and s.policy_step == 0 for s in pending)


def test_unfinished_answers_are_continued_first_by_the_next_weights_and_tagged():
    sampler, engine = make(dynamic_sampling=False)
    batches = steps(sampler, 6)
    continued = [b.metrics["rollout/continued_answers"] for b in batches]
    assert continued[0] == 0 and sum(continued[1:]) > 0
    mixed = [s for b in batches for g in b.groups for s in g.samples if len(s.token_versions()) > 1]
    assert mixed, "no answer was continued across a weight update"
    assert any(b.metrics["rollout/off_policy_token_frac"] > 0 for b in batches)
    for step, batch in enumerate(batches):
        check_tags(batch, step, max_staleness=1)


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_no_trained_token_is_older_than_the_staleness_bound(max_staleness):
    sampler, _ = make(partial_max_staleness=max_staleness, dynamic_sampling=False)
    batches = steps(sampler, 8)
    for step, batch in enumerate(batches):
        check_tags(batch, step, max_staleness)
        assert batch.metrics["rollout/policy_lag_max"] <= max_staleness
    if max_staleness == 0:
        assert sum(b.metrics["rollout/stale_dropped_answers"] for b in batches) > 0


def test_groups_are_filtered_only_when_whole():
    sampler, _ = make()  # dynamic sampling on: a kept group has 0 < accuracy < 1
    for step, batch in enumerate(steps(sampler, 5)):
        assert len(batch.groups) == 4
        assert all(0 < g.accuracy < 1 for g in batch.groups)
        check_tags(batch, step, max_staleness=1)
    assert all(not all(s.finished for s in g.samples) for g in sampler.pending.own)


def test_the_unfinished_answers_are_saved_with_the_sampler_and_continued_after_a_resume():
    sampler, _ = make(dynamic_sampling=False)
    steps(sampler, 2)
    assert sampler.pending.own
    state, files = copy.deepcopy(sampler.state_dict()), copy.deepcopy(sampler.own_files())
    resumed, _ = make(dynamic_sampling=False)
    resumed.load_state_dict(state, read=files.__getitem__)
    after, again = steps(sampler, 3, first=2), steps(resumed, 3, first=2)
    for a, b in zip(after, again):
        assert a.metrics == b.metrics
        tokens = lambda batch: [[list(s.response_ids) for s in g.samples] for g in batch.groups]
        assert tokens(a) == tokens(b)


def test_with_partial_rollout_a_carried_group_older_than_the_staleness_bound_is_not_trained():
    """carry_surplus=true: a group finished one step late and then carried trained answers of lag 2 while
    partial_max_staleness was 1 (docs/algorithm.md: no trained token is older)."""
    settings = SamplerSettings(**{**SETTINGS, "partial_rollout": True, "carry_surplus": True})
    s = RolloutSampler(
        GuardedEngine("hf", lambda: LongTailEngine(heavy_tail)), FakeTokenizer(),
        PromptStream(ArithmeticTask(0, 99), seed=0), VerifierPool("dapo", workers=0).verify, settings,
        rank=0, world_size=1, all_gather=lambda obj: [obj], keep_filter=lambda group: True,
    )  # fmt: skip
    s.next_batch(0, PhaseTimer())
    assert s.carry, "the test needs carried groups"
    carried = {g.prompt.uid for g in s.carry}
    batch = s.next_batch(2, PhaseTimer())  # two updates after they were begun
    assert not carried & {g.prompt.uid for g in batch.groups}
    assert max(2 - smp.policy_step for g in batch.groups for smp in g.samples) <= 1


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s.update(response_ids=[-5, *s["response_ids"][1:]]), "answer 0: token id -5 (ids are >= 0)"),
        (lambda s: s.update(response_ids="abc"), "is not what the run wrote: "),
        (lambda s: s.update(policy_step=99, version_runs=[]), "weight version 99, newer than the save's step 1"),
        (lambda s: s.update(rollout_logprobs=[0.5] * len(s["response_ids"])), "a log-prob that is not finite or"),
        # it was sent to the engine, which failed on it: blamed on the engine
        (lambda s: s.update(response_ids=[5000, *s["response_ids"][1:]]), "token id 5000, past the model's vocabulary"),
    ],
)
def test_a_hand_edited_partial_rollout_buffer_is_refused_naming_the_group(edit, message):
    """Out-of-vocabulary ids were blamed on the engine, a wrong type was a TypeError, a version from the future
    a negative lag."""
    from dapo_mcore.utils.errors import CheckpointError

    sampler, _ = make(dynamic_sampling=False)
    sampler.next_batch(0, PhaseTimer())
    state, files = copy.deepcopy(sampler.state_dict()), copy.deepcopy(sampler.own_files())
    ((name, groups),) = files.items()
    group = next(g for g in groups if any(len(s["response_ids"]) for s in g["samples"]))
    edit(next(s for s in group["samples"] if len(s["response_ids"])))
    fresh, _ = make(dynamic_sampling=False)
    with pytest.raises(CheckpointError, match=f"the save's unfinished group [0-9]+ in {name}") as err:
        fresh.load_state_dict(state, step=1, read=files.__getitem__, vocab_size=1000)
    assert message in str(err.value), str(err.value)
    as_written = copy.deepcopy(sampler.own_files())
    fresh.load_state_dict(copy.deepcopy(sampler.state_dict()), step=1, read=as_written.__getitem__)  # taken
