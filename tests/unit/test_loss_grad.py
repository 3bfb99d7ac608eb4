"""The DAPO numerator's per-token gradient (algo/losses.py `dapo_loss_grad`: per-token constants from
`token_loss_terms`, autograd through `token_losses` token by token) equals autograd through the aggregated
`dapo_loss` in float64, for every aggregation mode and option, with tokens exactly on the clip, dual-clip and
clamp boundaries (where autograd's tie and edge rules decide)."""

import math

import pytest
import torch

from dapo_mcore.algo.losses import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    LossSettings,
    dapo_loss,
    dapo_loss_grad,
    token_loss_grad,
    token_loss_terms,
)

F64 = torch.float64
CLAMP = 20.0  # losses._LOG_RATIO_CLAMP
# Row 0's log-ratios: clip-high bound, clip-low bound, dual-clip bound, 1, the +-20 clamp and past it.
BOUNDARY_LOG_RATIOS = [math.log(1.28), math.log(0.8), math.log(3.0), 0.0, CLAMP, -CLAMP, 25.0, -25.0, 0.4, -0.3]
# Row 1's log(pi / pi_ref): 0 (abs has a kink), the +-20 clamp of low_var_kl, its 10 cap (k3(5) = 142).
BOUNDARY_KL = [0.0, -CLAMP, CLAMP, -5.0]


def make_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    b, t = 6, len(BOUNDARY_LOG_RATIOS)
    logp = torch.randn(b, t, generator=g, dtype=F64) * 0.5 - 2.0
    old = logp + torch.randn(b, t, generator=g, dtype=F64) * 0.4
    logp[0], old[0] = torch.tensor(BOUNDARY_LOG_RATIOS, dtype=F64), 0.0  # logp - 0: exactly these
    logp[1], old[1] = logp[0], old[0]  # the same tokens with the other sign of advantage
    ref = logp + torch.randn(b, t, generator=g, dtype=F64) * 0.3
    logp[2, :4] = -1.5
    ref[2, :4] = -1.5 - torch.tensor(BOUNDARY_KL, dtype=F64)  # exact differences
    adv = torch.randn(b, t, generator=g, dtype=F64) * 1.5
    adv[0], adv[1], adv[3, :3] = 1.3, -0.7, 0.0
    mask = (torch.rand(b, t, generator=g) > 0.3).to(F64)
    mask[:2], mask[5] = 1.0, 0.0  # every boundary token counts; one sequence without loss tokens
    return {
        "logp": logp,
        "old": old,
        "adv": adv,
        "mask": mask,
        "ref": ref,
        "rollout": old + torch.randn(b, t, generator=g, dtype=F64) * 0.3,
        "entropy": torch.rand(b, t, generator=g, dtype=F64) + 0.1,
    }


def boundary_clips(batch) -> dict:
    """clip_low/high and dual_clip_c equal to row 0's ratios as dapo_loss computes them, bit for bit
    (r - 1 and 1 - r are exact for r in [0.5, 2], so 1 + clip_high == r again)."""
    ratio = (batch["logp"] - batch["old"]).clamp(-CLAMP, CLAMP).exp()[0].tolist()
    return {"clip_high": ratio[0] - 1.0, "clip_low": 1.0 - ratio[1], "dual_clip_c": ratio[2]}


OPTIONS = {
    "clip-higher": {},
    "dual-clip": {"dual_clip": True},
    "tis-token": {"tis": "token", "tis_cap": 1.2},
    "tis-sequence-mask": {"tis": "sequence_mask", "seq_mask_low": 0.95, "seq_mask_high": 1.05},
    **{f"kl-{e}": {"kl_beta": 0.1, "kl_estimator": e} for e in KL_ESTIMATORS},
    "entropy": {"entropy_coeff": 0.03},
    "guard-keeps": {"early_stop_ratio": 1e12},
    "guard-drops": {"early_stop_ratio": 1.0},
    "everything": {"dual_clip": True, "tis": "token", "kl_beta": 0.05, "entropy_coeff": 0.01, "early_stop_ratio": 1e12},
}


def settings(batch, mode, options) -> LossSettings:
    options, clips = dict(options), boundary_clips(batch)
    if not options.pop("dual_clip", False):
        clips["dual_clip_c"] = None
    return LossSettings(agg_mode=mode, norm_len=7, **clips, **options)


def autograd_grads(batch, s):
    logp = batch["logp"].clone().requires_grad_()
    entropy = batch["entropy"].clone().requires_grad_()
    numerator, _, _ = dapo_loss(
        logp,
        batch["old"],
        batch["adv"],
        batch["mask"],
        s,
        entropy_BT=entropy,
        ref_logprobs_BT=batch["ref"],
        rollout_logprobs_BT=batch["rollout"],
    )
    return torch.autograd.grad(numerator, (logp, entropy), allow_unused=True)


def grads(batch, s):
    return dapo_loss_grad(
        batch["logp"],
        batch["old"],
        batch["adv"],
        batch["mask"],
        s,
        ref_logprobs_BT=batch["ref"],
        rollout_logprobs_BT=batch["rollout"],
    )


def test_row_zero_sits_exactly_on_the_clip_and_dual_clip_bounds():
    batch = make_batch()
    s = settings(batch, "token-mean", OPTIONS["dual-clip"])
    ratio = (batch["logp"] - batch["old"]).clamp(-CLAMP, CLAMP).exp()[0]
    assert ratio[0].item() == 1.0 + s.clip_high and ratio[1].item() == 1.0 - s.clip_low
    assert ratio[2].item() == s.dual_clip_c and ratio[3].item() == 1.0


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gradient_equals_autograd_in_float64(mode, option):
    for seed in range(3):
        batch = make_batch(seed)
        s = settings(batch, mode, OPTIONS[option])
        want_logp, want_entropy = autograd_grads(batch, s)
        got_logp, got_entropy = grads(batch, s)
        torch.testing.assert_close(got_logp, want_logp, rtol=1e-12, atol=1e-15)
        if s.entropy_coeff > 0.0:
            torch.testing.assert_close(got_entropy, want_entropy, rtol=1e-12, atol=1e-15)
        else:
            assert got_entropy is None and want_entropy is None
        if option == "guard-drops":
            assert not got_logp.any()
        elif option == "tis-sequence-mask":  # some sequences dropped, some kept
            assert 0 < (got_logp != 0).any(dim=-1).sum() < (batch["mask"].sum(dim=-1) > 0).sum()
        else:
            assert got_logp[0].any() and got_logp[1].any()  # the boundary rows are not all masked away


def test_boundary_tokens_get_autograds_edge_values():
    """By hand, A > 0 on row 0: at 1 + clip_high the clamp still passes (-A r); past it nothing passes;
    exactly at the +-20 log-ratio clamp the gradient passes, past it it is 0."""
    batch = make_batch()
    s = settings(batch, "seq-mean-token-sum", OPTIONS["clip-higher"])
    got, _ = grads(batch, s)
    ratio = (batch["logp"] - batch["old"]).clamp(-CLAMP, CLAMP).exp()[0]
    a = 1.3
    assert got[0, 0].item() == pytest.approx(-a * ratio[0].item(), rel=1e-15)  # r = 1 + clip_high: passes
    assert got[0, 2].item() == 0.0 and got[0, 4].item() == 0.0  # above the range with A > 0: clipped
    assert got[0, 3].item() == pytest.approx(-a)  # r = 1: both halves of the tie
    assert got[1, 5].item() == 0.0 and got[1, 7].item() == 0.0  # r = e^-20 < 1 - clip_low, A < 0: clipped
    assert got[1, 4].item() == pytest.approx(0.7 * math.exp(CLAMP))  # log-ratio 20, A < 0: passes
    assert got[1, 6].item() == 0.0  # log-ratio 25: clamped


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_terms_taken_at_some_tokens_give_those_tokens_gradients(mode):
    """The fused head takes the terms at response positions, then slices them per chunk."""
    batch = make_batch(1)
    s = settings(batch, mode, OPTIONS["everything"])
    terms = token_loss_terms(
        batch["old"], batch["adv"], batch["mask"], s, ref_logprobs_BT=batch["ref"], rollout_logprobs_BT=batch["rollout"]
    )
    full_logp, full_entropy = token_loss_grad(batch["logp"], terms, s)
    rows, cols = (batch["mask"] + (torch.rand(batch["mask"].shape) > 0.5)).nonzero(as_tuple=True)
    taken = terms.take((rows, cols))
    for a in range(0, len(rows), 4):
        part_logp, part_entropy = token_loss_grad(batch["logp"][rows, cols][a : a + 4], taken.take(slice(a, a + 4)), s)
        torch.testing.assert_close(part_logp, full_logp[rows, cols][a : a + 4], rtol=1e-14, atol=0)
        torch.testing.assert_close(part_entropy, full_entropy[rows, cols][a : a + 4], rtol=1e-14, atol=0)
