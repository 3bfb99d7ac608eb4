import pytest
import torch

from dapo_mcore.algo.shaping import linear_length_penalty, overlong_filter_mask, soft_overlong_penalty


def test_soft_overlong_penalty_at_the_boundaries():
    # L_max = 20, L_cache = 4: 0 up to exactly L_max - L_cache = 16, linear to -1 at exactly L_max, -1 beyond.
    lengths = torch.tensor([0, 15, 16, 17, 18, 19, 20, 21, 25])
    penalty = soft_overlong_penalty(lengths, max_len=20, buffer_len=4)
    assert penalty.tolist() == pytest.approx([0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0])


def test_soft_overlong_penalty_scales_with_its_factor():
    penalty = soft_overlong_penalty(torch.tensor([16, 18, 20, 30]), 20, 4, factor=0.5)
    assert penalty.tolist() == pytest.approx([0.0, -0.25, -0.5, -0.5])


def test_linear_length_penalty_stays_within_minus_one_and_zero():
    lengths = torch.tensor([0, 100, 150, 200, 300])
    assert linear_length_penalty(lengths, safe_len=100, max_len=200).tolist() == pytest.approx(
        [0.0, 0.0, -0.5, -1.0, -1.0]
    )
    assert linear_length_penalty(lengths, 100, 200, coef=0.5).tolist() == pytest.approx([0, 0, -0.25, -0.5, -1.0])
    assert linear_length_penalty(lengths, 100, 200, coef=4.0).min() == -1.0


def test_overlong_filter_masks_truncated_responses():
    assert overlong_filter_mask(torch.tensor([True, False])).tolist() == [0.0, 1.0]
