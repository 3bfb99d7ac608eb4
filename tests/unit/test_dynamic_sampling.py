import pytest
import torch

from dapo_mcore.algo.dynamic_sampling import KeepRateEstimator, keep_group_mask


def test_keep_group_mask_drops_all_correct_and_all_wrong_groups():
    correct = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 0, 0], [0, 1, 1]], dtype=torch.bool)
    assert keep_group_mask(correct).tolist() == [False, False, True, True]


def test_keep_rate_estimator_sizes_rounds_from_the_observed_rate():
    est = KeepRateEstimator(initial=1.0, smoothing=0.5, margin=1.0)
    assert est.round_size(needed=16, min_prompts=1, max_prompts=1000) == 16  # no observation yet
    est.observe(taken=16, kept=4)
    assert est.rate == pytest.approx(0.25)
    assert est.round_size(needed=12, min_prompts=1, max_prompts=1000) == 48
    est.observe(taken=48, kept=24)  # moving averages of both counts: (0.5 * 4 + 0.5 * 24) / (0.5 * 16 + 0.5 * 48)
    assert est.rate == pytest.approx(0.4375)
    assert est.round_size(needed=100, min_prompts=1, max_prompts=64) == 64
    est.observe(taken=10, kept=0)
    assert est.round_size(needed=1, min_prompts=8, max_prompts=1000) >= 8


def test_keep_rate_estimator_state_round_trips():
    est = KeepRateEstimator()
    est.observe(10, 3)
    again = KeepRateEstimator()
    again.load_state_dict(est.state_dict())
    assert again.round_size(5, 1, 100) == est.round_size(5, 1, 100)
