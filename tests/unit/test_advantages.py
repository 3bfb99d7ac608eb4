import math

import pytest
import torch

from dapo_mcore.algo.advantages import group_advantages


def test_grpo_advantage_is_reward_minus_mean_over_bessel_std():
    rewards = torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = group_advantages(rewards, groups, eps=0.0)
    std0 = math.sqrt((1.5**2 + 3 * 0.5**2) / 3)  # mean -0.5, Bessel: divide by n - 1
    assert adv[:4].tolist() == pytest.approx([1.5 / std0, -0.5 / std0, -0.5 / std0, -0.5 / std0])
    assert adv[4:].tolist() == [0.0, 0.0]  # equal rewards: zero advantage, whatever eps is


def test_eps_is_added_to_the_std():
    adv = group_advantages(torch.tensor([1.0, -1.0]), torch.tensor([0, 0]), eps=0.5)
    assert adv.tolist() == pytest.approx([1 / (math.sqrt(2) + 0.5), -1 / (math.sqrt(2) + 0.5)])


def test_mean_only_is_dr_grpo_without_std_division():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 3.0]), torch.tensor([0, 0, 1, 1]), estimator="mean_only")
    assert adv.tolist() == pytest.approx([0.5, -0.5, -1.5, 1.5])


def test_group_of_one_gets_zero_advantage_and_groups_may_differ_in_size():
    adv = group_advantages(torch.tensor([1.0, 3.0, -2.0, 0.0]), torch.tensor([0, 1, 1, 1]))
    assert adv[0] == 0.0 and adv[1] > 0 > adv[2]


def test_batch_normalization_gives_mean_zero_std_one():
    torch.manual_seed(0)
    rewards, groups = torch.randn(32), torch.arange(32) // 4
    adv = group_advantages(rewards, groups, batch_normalize=True)
    assert adv.mean().abs() < 1e-6 and adv.std().item() == pytest.approx(1.0, abs=1e-5)


def test_unknown_estimator_is_an_error():
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        group_advantages(torch.ones(2), torch.zeros(2, dtype=torch.long), estimator="ppo")
