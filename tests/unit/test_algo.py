import math

import pytest
import torch

from dapo_mcore.algo.advantages import group_advantages
from dapo_mcore.algo.dynamic_sampling import keep_group_mask
from dapo_mcore.algo.losses import clipped_policy_loss
from dapo_mcore.algo.shaping import overlong_filter_mask, soft_overlong_penalty


def test_group_advantage_is_reward_minus_mean_over_bessel_std():
    rewards = torch.tensor([1.0, -1.0, -1.0, -1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    adv = group_advantages(rewards, groups, eps=0.0)
    std0 = math.sqrt(((1.5) ** 2 + 3 * 0.5**2) / 3)  # mean -0.5, Bessel: divide by n - 1
    assert adv[:4].tolist() == pytest.approx([1.5 / std0, -0.5 / std0, -0.5 / std0, -0.5 / std0])
    assert adv[4:].tolist() == [0.0, 0.0]  # equal rewards: zero advantage, eps keeps it finite


def test_group_of_one_gets_zero_advantage():
    adv = group_advantages(torch.tensor([1.0, 3.0, -2.0]), torch.tensor([0, 1, 1]))
    assert adv[0] == 0.0 and adv[1] > 0 > adv[2]


def test_soft_overlong_penalty_boundaries():
    # L_max = 20, L_cache = 4: safe up to 16, linear to -1 at 20, -1 beyond.
    lengths = torch.tensor([0, 16, 17, 18, 20, 25])
    penalty = soft_overlong_penalty(lengths, max_len=20, buffer_len=4)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    assert soft_overlong_penalty(lengths, 20, 4, factor=0.5).tolist() == pytest.approx(
        [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]
    )


def test_overlong_filter_masks_truncated_responses():
    assert overlong_filter_mask(torch.tensor([True, False])).tolist() == [0.0, 1.0]


def test_keep_group_mask_drops_all_correct_and_all_wrong_groups():
    correct = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 0, 0], [0, 1, 1]], dtype=torch.bool)
    assert keep_group_mask(correct).tolist() == [False, False, True, True]


def test_clipped_loss_hand_values_and_clip_counts():
    # ratios e^0.5 = 1.65 (A>0: clipped high), e^-0.5 = 0.61 (A<0: clipped low), 1.1 (A>0: inside)
    logp = torch.log(torch.tensor([1.6487212707, 0.6065306597, 1.1, 1.1]))
    old = torch.zeros(4)
    adv = torch.tensor([2.0, -1.0, 1.0, 5.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    loss_sum, n_tok, counts = clipped_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    expected = -(2.0 * 1.28) + (1.0 * 0.8) - (1.0 * 1.1)  # -min(rA, clip(r)A) per token
    assert loss_sum.item() == pytest.approx(expected, rel=1e-6)
    assert n_tok.item() == 3
    assert counts["clip_high"].item() == 1 and counts["clip_low"].item() == 1


def test_clipped_tokens_get_no_gradient_and_unclipped_get_minus_a_times_r():
    logp = torch.log(torch.tensor([1.5, 0.7, 1.1])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 1.0])
    loss, _, _ = clipped_policy_loss(logp, torch.zeros(3), adv, torch.ones(3), 0.2, 0.28)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, -1.1])  # d(-A r)/dlogp = -A r


def test_clip_higher_lets_positive_advantages_grow_further_than_symmetric_clip():
    logp = torch.log(torch.tensor([1.25])).requires_grad_()
    for clip_high, grad in ((0.2, 0.0), (0.28, -1.25)):
        logp.grad = None
        clipped_policy_loss(logp, torch.zeros(1), torch.ones(1), torch.ones(1), 0.2, clip_high)[0].backward()
        assert logp.grad.item() == pytest.approx(grad)
