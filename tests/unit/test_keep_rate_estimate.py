"""The adaptive round size's keep-rate estimate (algo/dynamic_sampling.py KeepRateEstimator): under partial rollout
it counts the prompts each round takes, not the groups it returns, so long answers left unfinished are not left
out of it; older saves still load."""

import pytest

from dapo_mcore.algo.dynamic_sampling import KeepRateEstimator
from dapo_mcore.data.arithmetic import ArithmeticTask
from dapo_mcore.data.datasets import PromptStream
from dapo_mcore.rewards.pool import VerifierPool
from dapo_mcore.rollout.sampler import RolloutSampler, SamplerSettings
from dapo_mcore.utils.seeding import derive_seed
from dapo_mcore.utils.timers import PhaseTimer
from tests.helpers import FakeTokenizer, LongTailEngine


def first_operand(prompt_text: str) -> int:
    return int(prompt_text.removeprefix("What is ").split("+")[0])


def hard_prompts_answer_long(prompt_text: str, seed: int) -> tuple[int, bool]:
    """(length, correct) of an answer. Prompts with an even first operand are hard: 100-199 tokens, every answer
    wrong (the filter drops the group); the others take 4-11 tokens, half right (the group is kept)."""
    draw = derive_seed(7, prompt_text, seed)
    if first_operand(prompt_text) % 2 == 0:
        return 100 + draw % 100, False
    return 4 + draw % 8, seed % 2 == 0


def test_the_estimate_under_partial_rollout_is_the_keep_rate_of_every_prompt_not_of_the_short_answers():
    settings = SamplerSettings(
        n_samples_per_prompt=4, prompts_per_step=4, gen_prompts_per_round=8, temperature=1.0, top_p=1.0,
        max_response_len=256, seed=0, overlong_buffer_len=4, max_rounds=8, partial_rollout=True,
        partial_oversample=2.0, adaptive=True, adaptive_max_prompts=64,
    )  # fmt: skip
    sampler = RolloutSampler(
        LongTailEngine(hard_prompts_answer_long), FakeTokenizer(), PromptStream(ArithmeticTask(0, 99), seed=0),
        VerifierPool("dapo", workers=0).verify, settings, rank=0, world_size=1, all_gather=lambda obj: [obj],
    )  # fmt: skip
    estimates = [
        sampler.next_batch(step, PhaseTimer()).metrics["dynamic_sampling/keep_rate_estimate"] for step in range(16)
    ]
    taken = PromptStream(ArithmeticTask(0, 99), seed=0).take(sampler.prompts.taken)
    true_rate = sum(first_operand(p.text) % 2 for p in taken) / len(taken)
    assert 0.35 < true_rate < 0.55
    # The hard groups' answers outlast the rounds that stop at the step's 4 groups and are dropped as stale
    # unjudged: counting only the groups a round returned, the estimate was about 1.0.
    late = estimates[8:]
    assert sum(late) / len(late) == pytest.approx(true_rate, abs=0.1)


def test_a_round_that_takes_no_prompt_still_counts_its_kept_groups():
    est = KeepRateEstimator(smoothing=0.5)
    est.observe(taken=20, kept=5)
    est.observe(taken=0, kept=5)  # every input was a continued group: 10 kept of 20 taken in all
    assert est.rate == pytest.approx((0.5 * 5 + 0.5 * 5) / (0.5 * 20))


def test_a_save_from_before_the_weight_loads_and_weighs_as_the_next_round():
    est = KeepRateEstimator(smoothing=0.5)
    est.load_state_dict({"rate": 0.25})  # the sampler state of an older run
    est.observe(taken=16, kept=8)
    assert est.rate == pytest.approx(0.5 * 0.25 + 0.5 * 0.5)  # as the old average of round rates
    again = KeepRateEstimator(smoothing=0.5)
    again.load_state_dict(est.state_dict())
    assert (again.rate, again.weight) == (est.rate, est.weight)


def test_a_rate_above_one_never_asks_for_fewer_prompts_than_groups_needed():
    est = KeepRateEstimator(margin=1.0)
    est.observe(taken=2, kept=6)  # a partial-rollout buffer draining
    assert est.round_size(needed=8, min_prompts=1, max_prompts=100) == 8
