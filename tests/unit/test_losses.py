"""DAPO loss: hand-computed values for every option, and gradients against a naive per-token loop."""

import math

import pytest
import torch

from dapo_mcore.algo.losses import LOSS_AGG_MODES, LossSettings, aggregate, dapo_loss, kl_penalty, stat_keys

S = LossSettings(clip_low=0.2, clip_high=0.28, dual_clip_c=None)


def rows(*values):
    return torch.tensor([list(values)], dtype=torch.float64)


def loss_value(logp, old, adv, mask, s=S, **kw):
    num, den, stats = dapo_loss(logp, old, adv, mask, s, **kw)
    return num, den, stats


def test_clip_higher_hand_values_and_clip_counts():
    # ratios 1.65 (A>0: clipped high), 0.61 (A<0: clipped low), 1.1 (inside), masked token
    logp = torch.log(rows(1.6487212707, 0.6065306597, 1.1, 1.1))
    adv, mask = rows(2.0, -1.0, 1.0, 5.0), rows(1, 1, 1, 0)
    num, den, stats = loss_value(logp, torch.zeros_like(logp), adv, mask)
    assert num.item() == pytest.approx(-(2.0 * 1.28) + (1.0 * 0.8) - (1.0 * 1.1), rel=1e-9)
    assert den.item() == 3 and stats["clip_high"].item() == 1 and stats["clip_low"].item() == 1


def test_ratio_exactly_at_the_clip_bounds_is_not_counted_as_clipped():
    logp = torch.log(rows(1.28, 0.8))
    _, _, stats = loss_value(logp, torch.zeros_like(logp), rows(1.0, -1.0), rows(1, 1))
    assert stats["clip_high"].item() == 0 and stats["clip_low"].item() == 0


def test_clipped_tokens_get_no_gradient_and_unclipped_get_minus_a_times_r():
    logp = torch.log(rows(1.5, 0.7, 1.1)).requires_grad_()
    num, _, _ = loss_value(logp, torch.zeros(1, 3, dtype=torch.float64), rows(1.0, -1.0, 1.0), rows(1, 1, 1))
    num.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, 0.0, -1.1])  # d(-A r)/dlogp = -A r


def test_symmetric_clip_stops_what_clip_higher_lets_grow():
    for clip_high, grad in ((0.2, 0.0), (0.28, -1.25)):
        logp = torch.log(rows(1.25)).requires_grad_()
        s = LossSettings(clip_low=0.2, clip_high=clip_high, dual_clip_c=None)
        dapo_loss(logp, torch.zeros(1, 1, dtype=torch.float64), rows(1.0), rows(1), s)[0].backward()
        assert logp.grad.item() == pytest.approx(grad)


def test_dual_clip_bounds_the_loss_of_negative_advantages_at_c_times_abs_a():
    s = LossSettings(dual_clip_c=10.0)
    logp = torch.log(rows(12.0, 5.0, 12.0)).requires_grad_()
    num, _, stats = dapo_loss(logp, torch.zeros(1, 3, dtype=torch.float64), rows(-1.0, -1.0, 1.0), rows(1, 1, 1), s)
    # A<0, r=12 > c: c|A| = 10 (no gradient); A<0, r=5: r|A| = 5; A>0, r=12: -(1.28)
    assert num.item() == pytest.approx(10.0 + 5.0 - 1.28)
    num.backward()
    assert logp.grad[0].tolist() == pytest.approx([0.0, 5.0, 0.0])
    assert stats["dual_clip"].item() == 1


def test_dual_clip_must_exceed_one():
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        LossSettings(dual_clip_c=0.9)


def test_aggregation_modes_hand_values():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 0.0], [9.0, 9.0, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.float64)  # third row: padding
    expected = {
        "token-mean": (15.0, 5.0),
        "seq-mean-token-mean": (2.0 + 4.5, 2.0),
        "seq-mean-token-sum": (15.0, 2.0),
        "seq-mean-token-sum-norm": (15.0 / 10, 2.0),
    }
    for mode, (num, den) in expected.items():
        got = aggregate(loss, mask, mode, norm_len=10)
        assert (got[0].item(), got[1].item()) == pytest.approx((num, den)), mode


@pytest.mark.parametrize(
    "estimator, value", [("kl", 0.5), ("abs", 0.5), ("mse", 0.125), ("low_var_kl", math.exp(-0.5) + 0.5 - 1.0)]
)
def test_kl_estimators_hand_values(estimator, value):
    kl = kl_penalty(torch.tensor([0.5], dtype=torch.float64), torch.tensor([0.0], dtype=torch.float64), estimator)
    assert kl.item() == pytest.approx(value)


def test_low_var_kl_is_clamped_to_ten():
    kl = kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "low_var_kl")
    assert kl.item() == 10.0


def test_kl_and_entropy_terms_enter_the_loss():
    logp, ref = rows(-1.0, -2.0), rows(-1.5, -2.0)
    ent = rows(0.3, 0.7)
    s = LossSettings(kl_beta=0.1, kl_estimator="kl", entropy_coeff=0.01, dual_clip_c=None)
    num, _, stats = dapo_loss(logp, logp, rows(1.0, 1.0), rows(1, 1), s, entropy_BT=ent, ref_logprobs_BT=ref)
    assert num.item() == pytest.approx(-2.0 + 0.1 * 0.5 - 0.01 * 1.0)
    assert stats["kl"].item() == pytest.approx(0.5)


def test_token_tis_weights_the_policy_loss_by_the_capped_rollout_ratio():
    s = LossSettings(tis="token", tis_cap=2.0, dual_clip_c=None)
    old, rollout = rows(0.0, 0.0), rows(math.log(0.5), math.log(0.1))  # weights 2.0 and 10 -> capped 2.0
    num, _, stats = dapo_loss(rows(0.0, 0.0), old, rows(1.0, 1.0), rows(1, 1), s, rollout_logprobs_BT=rollout)
    assert num.item() == pytest.approx(-(2.0 + 2.0))
    assert stats["tis_truncated"].item() == 1 and stats["tis_weight"].item() == pytest.approx(4.0)


def test_sequence_mask_drops_sequences_whose_geometric_mean_ratio_is_out_of_range():
    s = LossSettings(tis="sequence_mask", seq_mask_low=0.5, seq_mask_high=2.0, dual_clip_c=None)
    zeros = torch.zeros(2, 2, dtype=torch.float64)
    rollout = torch.tensor([[0.0, -0.2], [-1.0, -1.0]], dtype=torch.float64)  # row 2: weight e ~ 2.7
    num, den, stats = dapo_loss(
        zeros, zeros, torch.ones(2, 2, dtype=torch.float64), torch.ones(2, 2), s, rollout_logprobs_BT=rollout
    )
    assert den.item() == 2 and stats["seq_masked"].item() == 1 and num.item() == pytest.approx(-2.0)


def test_tis_without_rollout_logprobs_is_an_error():
    with pytest.raises(ValueError, match="needs the rollout engine's log-probs"):
        dapo_loss(rows(0.0), rows(0.0), rows(1.0), rows(1), LossSettings(tis="token"))


def test_guard_skips_a_micro_batch_whose_mean_ratio_explodes():
    s = LossSettings(early_stop_ratio=3.0, dual_clip_c=None)
    num, den, stats = dapo_loss(rows(2.0, 2.0), rows(0.0, 0.0), rows(1.0, 1.0), rows(1, 1), s)  # ratio e^2
    assert num.item() == 0.0 and den.item() == 0.0 and stats["skipped_micro_batches"].item() == 1.0
    num, den, stats = dapo_loss(rows(0.1, 0.1), rows(0.0, 0.0), rows(1.0, 1.0), rows(1, 1), s)
    assert den.item() == 2 and stats["skipped_micro_batches"].item() == 0.0


def test_stat_keys_name_exactly_what_the_loss_returns():
    s = LossSettings(dual_clip_c=3.0, tis="token", kl_beta=0.1, early_stop_ratio=5.0)
    _, _, stats = dapo_loss(
        rows(0.0), rows(0.0), rows(1.0), rows(1), s, ref_logprobs_BT=rows(0.0), rollout_logprobs_BT=rows(0.0)
    )
    assert set(stats) == set(stat_keys(s))


# ---- the same loss written as a naive loop over tokens, in float64 --------------------------------------
def naive_objective(logp, old, adv, mask, s: LossSettings, ent, ref):
    per_seq, tokens_per_seq, total = [], [], 0.0
    for i in range(logp.shape[0]):
        seq_sum, n = 0.0, 0
        for t in range(logp.shape[1]):
            if mask[i, t] == 0:
                continue
            r = torch.exp(logp[i, t] - old[i, t])
            a = adv[i, t]
            pg = torch.maximum(-a * r, -a * torch.clamp(r, 1 - s.clip_low, 1 + s.clip_high))
            if s.dual_clip_c is not None and a < 0:
                pg = torch.minimum(pg, -a * s.dual_clip_c)
            x = logp[i, t] - ref[i, t]
            seq_sum = seq_sum + pg + s.kl_beta * (torch.exp(-x) + x - 1) - s.entropy_coeff * ent[i, t]
            n += 1
        if n:
            per_seq.append(seq_sum)
            tokens_per_seq.append(n)
            total = total + seq_sum
    if s.agg_mode == "token-mean":
        return total / sum(tokens_per_seq)
    if s.agg_mode == "seq-mean-token-mean":
        return sum(v / n for v, n in zip(per_seq, tokens_per_seq)) / len(per_seq)
    if s.agg_mode == "seq-mean-token-sum":
        return total / len(per_seq)
    return total / (len(per_seq) * s.norm_len)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gradient_matches_a_naive_per_token_loop_in_float64(mode):
    torch.manual_seed(3)
    b, t = 4, 6
    logp = (torch.randn(b, t, dtype=torch.float64) * 0.3 - 1.0).requires_grad_()
    ent = (torch.rand(b, t, dtype=torch.float64) + 0.1).requires_grad_()
    old = logp.detach() + torch.randn(b, t, dtype=torch.float64) * 0.3
    ref = logp.detach() + torch.randn(b, t, dtype=torch.float64) * 0.2
    adv = torch.randn(b, 1, dtype=torch.float64).expand(b, t) * 2
    mask = (torch.rand(b, t) > 0.25).double()
    mask[2] = 0  # a sequence with no loss token
    s = LossSettings(agg_mode=mode, norm_len=7, dual_clip_c=1.5, kl_beta=0.05, entropy_coeff=0.02)
    num, den, _ = dapo_loss(logp, old, adv, mask, s, entropy_BT=ent, ref_logprobs_BT=ref)
    got = torch.autograd.grad(num / den, (logp, ent))
    want = torch.autograd.grad(naive_objective(logp, old, adv, mask, s, ent, ref), (logp, ent))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
