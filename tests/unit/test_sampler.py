"""The dynamic-sampling loop: round cap behaviour, batch modes, adaptive rounds, carry-over, filters."""

import io
import re

import pytest
import torch

from dapo_mcore.data.arithmetic import ArithmeticTask
from dapo_mcore.data.datasets import PromptStream
from dapo_mcore.rewards.pool import VerifierPool
from dapo_mcore.rollout.agreement import LocalBoard
from dapo_mcore.rollout.sampler import DynamicSamplingCapError, RolloutSampler, SamplerSettings
from dapo_mcore.utils.timers import PhaseTimer
from tests.helpers import FakeTokenizer, ScriptedEngine, group_as_lists
from tests.verifiers import keep_even_sums

BASE = dict(
    n_samples_per_prompt=4,
    prompts_per_step=8,
    gen_prompts_per_round=8,
    temperature=1.0,
    top_p=1.0,
    max_response_len=16,
    seed=0,
    overlong_buffer_len=4,
)


def sampler(correct, verifier="dapo", workers=0, timeout_s=10.0, keep_filter=None, **overrides):
    engine = ScriptedEngine(correct)
    pool = VerifierPool(verifier, workers=workers, timeout_s=timeout_s)
    kwargs = {"keep_filter": keep_filter} if keep_filter else {}
    s = RolloutSampler(
        engine,
        FakeTokenizer(),
        PromptStream(ArithmeticTask(0, 9), seed=0),
        pool.verify,
        SamplerSettings(**{**BASE, **overrides}),
        rank=0,
        world_size=1,
        all_gather=lambda obj: [obj],
        **kwargs,
    )
    return s, engine, pool


def half_right(text, j):
    return j % 2 == 0


def right_for_even_operand(text, j):
    a = int(text.removeprefix("What is ").split("+")[0])
    return a % 2 == 0 and j == 0  # only groups with an even first operand have 0 < accuracy < 1


def test_informative_groups_fill_the_batch_in_one_round_with_signed_advantages():
    s, engine, _ = sampler(half_right)
    batch = s.next_batch(0, PhaseTimer())
    assert len(batch.groups) == 8 and engine.calls == [8]
    assert batch.metrics["rollout/accuracy"] == 0.5 and batch.metrics["dynamic_sampling/rounds"] == 1
    for g in batch.groups:
        assert [smp.advantage > 0 for smp in g.samples] == [True, False, True, False]


def test_round_cap_trains_on_the_kept_groups_with_a_warning(caplog):
    s, engine, _ = sampler(right_for_even_operand, max_rounds=2, prompts_per_step=100)
    with caplog.at_level("WARNING", logger="dapo_mcore"):
        batch = s.next_batch(0, PhaseTimer())
    assert re.search(r"kept \d+ of 100 groups after 2 rounds.*training on the kept groups", caplog.text)
    assert 0 < len(batch.groups) < 100 and len(engine.calls) == 2 and batch.metrics["dynamic_sampling/cap_hit"] == 1
    assert all(0 < g.accuracy < 1 for g in batch.groups)


def test_round_cap_in_strict_mode_stops_with_a_clear_error():
    s, _, _ = sampler(right_for_even_operand, max_rounds=2, prompts_per_step=100, on_cap="error")
    with pytest.raises(DynamicSamplingCapError, match="kept .* of 100 groups after 2 rounds.*on_cap=error"):
        s.next_batch(0, PhaseTimer())


def test_nothing_kept_at_the_cap_gives_an_empty_batch_not_a_crash(caplog):
    s, _, _ = sampler(lambda text, j: True, max_rounds=1)
    with caplog.at_level("WARNING", logger="dapo_mcore"):
        batch = s.next_batch(0, PhaseTimer())
    assert "no group to train on" in caplog.text
    assert batch.groups == [] and batch.metrics["dynamic_sampling/all_correct_groups"] == 8


def test_surplus_groups_are_dropped_by_default_as_in_the_paper():
    s, engine, _ = sampler(half_right, prompts_per_step=6, gen_prompts_per_round=8)
    first = s.next_batch(0, PhaseTimer())
    assert len(first.groups) == 6 and s.carry == []
    assert first.metrics["dynamic_sampling/dropped_surplus_groups"] == 2
    second = s.next_batch(1, PhaseTimer())
    assert len(engine.calls) == 2 and all(smp.policy_step == 1 for g in second.groups for smp in g.samples)
    assert second.metrics["rollout/off_policy_frac"] == 0.0 and second.metrics["rollout/policy_lag_max"] == 0


def test_carried_surplus_groups_train_next_step_and_are_counted_off_policy():
    s, engine, _ = sampler(half_right, prompts_per_step=6, gen_prompts_per_round=8, carry_surplus=True)
    first = s.next_batch(0, PhaseTimer())
    assert len(first.groups) == 6 and first.metrics["dynamic_sampling/carried_groups"] == 2
    assert first.metrics["dynamic_sampling/dropped_surplus_groups"] == 0
    carried = s.carry[:]
    second = s.next_batch(1, PhaseTimer())
    assert second.groups[:2] == carried and len(engine.calls) == 2
    assert second.metrics["rollout/off_policy_frac"] == pytest.approx(2 / 6)  # 2 of 6 groups, same n each
    assert second.metrics["rollout/policy_lag_max"] == 1


def test_dynamic_batch_mode_trains_on_one_round_of_accepted_groups():
    s, engine, _ = sampler(right_for_even_operand, mode="dynamic_batch", prompts_per_step=10)
    batch = s.next_batch(0, PhaseTimer())
    assert engine.calls == [10] and 0 < len(batch.groups) < 10 and s.carry == []


def test_adaptive_rounds_follow_the_keep_rate():
    s, engine, _ = sampler(right_for_even_operand, adaptive=True, prompts_per_step=8, adaptive_max_prompts=64)
    s.next_batch(0, PhaseTimer())
    s.next_batch(1, PhaseTimer())
    assert engine.calls[0] == 9  # no estimate yet: what is needed, with a 10% margin
    assert max(engine.calls[1:]) > 9  # about half the groups are kept: later rounds ask for more


def test_disabled_dynamic_sampling_keeps_uninformative_groups():
    s, _, _ = sampler(lambda text, j: True, dynamic_sampling=False)
    batch = s.next_batch(0, PhaseTimer())
    assert len(batch.groups) == 8 and all(smp.advantage == 0 for g in batch.groups for smp in g.samples)


def test_without_dynamic_sampling_a_round_is_the_step_and_nothing_is_left_over():
    """GRPO's step: every group is kept, so a round of gen_prompts_per_round > prompts_per_step only left groups over
    that trained a step later (carry_surplus), half the steps generating nothing."""
    s, engine, _ = sampler(half_right, dynamic_sampling=False, prompts_per_step=6, gen_prompts_per_round=16,
                           carry_surplus=True)  # fmt: skip
    for step in range(2):
        batch = s.next_batch(step, PhaseTimer())
        assert len(batch.groups) == 6 and batch.metrics["dynamic_sampling/carried_groups"] == 0
    assert engine.calls == [6, 6] and s.carry == []


def test_a_custom_filter_decides_what_is_kept():
    s, _, _ = sampler(half_right, keep_filter=keep_even_sums, prompts_per_step=4)
    assert all(int(g.prompt.answer) % 2 == 0 for g in s.next_batch(0, PhaseTimer()).groups)


def test_a_verifier_that_never_returns_times_out_and_the_step_finishes():
    def hmm_sometimes(text, j):
        return j == 0

    s, _, pool = sampler(hmm_sometimes, verifier="tests.verifiers:hang_on_hmm", workers=2, timeout_s=0.5)
    s.engine.generate_orig = s.engine.generate

    def with_hmm(prompt_ids, params):  # the second response of every group makes the verifier hang
        out = s.engine.generate_orig(prompt_ids, params)
        for group in out[:2]:
            group[1].text = "hmm " + group[1].text
        return out

    s.engine.generate = with_hmm
    try:
        batch = s.next_batch(0, PhaseTimer())
    finally:
        pool.close()
    assert batch.metrics["reward/timeouts"] == 2
    timed_out = [smp for g in batch.groups for smp in g.samples if smp.timed_out]
    assert len(timed_out) == 2 and not any(smp.correct for smp in timed_out)


def test_sampler_state_round_trips():
    s, _, _ = sampler(half_right, prompts_per_step=6, gen_prompts_per_round=8, carry_surplus=True)
    s.next_batch(0, PhaseTimer())
    assert s.carry, "the test needs carried-over groups"
    buffer = io.BytesIO()
    torch.save(s.state_dict(), buffer)  # as checkpoints store it: plain data that torch.load reads safely
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    t, _, _ = sampler(half_right, prompts_per_step=6, gen_prompts_per_round=8, carry_surplus=True)
    t.load_state_dict(state)
    a, b = s.next_batch(1, PhaseTimer()), t.next_batch(1, PhaseTimer())
    assert [g.prompt.uid for g in a.groups] == [g.prompt.uid for g in b.groups]
    assert [group_as_lists(g) for g in t.carry] == [group_as_lists(g) for g in s.carry]
    assert t.keep_rate.rate == s.keep_rate.rate


def test_ranks_of_one_engine_replica_send_the_same_prompts_and_seeds():
    """World 4 at engine TP=2: ranks {0,1} and {2,3} are two replicas; each replica takes half the prompts."""
    seen = {}

    class Recorder(ScriptedEngine):
        def generate(self, prompt_ids, params):
            seen[self.rank] = (prompt_ids, params.seed)
            return super().generate(prompt_ids, params)

    samplers, board = [], LocalBoard()  # one board, as the process group's store is: peers read leaders' verdicts
    for rank in range(4):
        engine = Recorder(half_right)
        engine.rank = rank
        samplers.append(
            RolloutSampler(
                engine,
                FakeTokenizer(),
                PromptStream(ArithmeticTask(0, 9), seed=0),
                lambda pairs: VerifierPool("dapo", workers=0).verify(pairs),
                SamplerSettings(**BASE),
                rank=rank,
                world_size=4,
                all_gather=lambda obj: [obj] * 4,  # a stand-in: only the replica split is checked here
                engine_tp_size=2,
                board=board,
            )
        )
        samplers[-1]._generate_round(step=0, round_idx=0, n_prompts=8, timer=PhaseTimer())
    assert seen[0] == seen[1] and seen[2] == seen[3]
    assert seen[0][0] != seen[2][0] and seen[0][1] != seen[2][1]
    assert len(seen[0][0]) + len(seen[2][0]) == 8


def test_a_resume_with_fewer_answers_per_prompt_says_the_saved_groups_are_trained_as_they_are(caplog):
    """The saved 8-answer groups were trained after a resume with rollout.n_samples_per_prompt=4 without a line."""
    s, _, _ = sampler(half_right, prompts_per_step=6, gen_prompts_per_round=8, carry_surplus=True)
    s.next_batch(0, PhaseTimer())
    n = s.settings.n_samples_per_prompt
    t, _, _ = sampler(half_right, prompts_per_step=6, gen_prompts_per_round=8, carry_surplus=True,
                      n_samples_per_prompt=n // 2)  # fmt: skip
    t.load_state_dict(s.state_dict())
    (warning,) = [r.getMessage() for r in caplog.records if "rollout.n_samples_per_prompt is now" in r.getMessage()]
    assert warning.startswith(f"the save holds {len(s.carry)} groups of [{n}] answers (carried over or unfinished)")
