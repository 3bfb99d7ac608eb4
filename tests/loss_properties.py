"""Shared hypothesis strategy and reference for the loss-split properties (unit and dist tiers): every
aggregation, policy loss and rollout correction."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from dapo_mcore.algo.losses import LOSS_AGG_MODES, POLICY_LOSSES, TIS_MODES, LossSettings, dapo_loss


@st.composite
def loss_batches(draw):
    """A mini-batch of B sequences with random masks, plus an assignment of rows to parts (micro/DP)."""
    # At least 3 rows of 2 tokens: with fewer, every part tends to hold the same token count, and a wrong
    # per-part normalisation would give the right answer by coincidence.
    b = draw(st.integers(3, 8))
    t = draw(st.integers(2, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    mode = draw(st.sampled_from(LOSS_AGG_MODES))
    policy_loss = draw(st.sampled_from(POLICY_LOSSES))
    tis = draw(st.sampled_from(TIS_MODES))
    parts = draw(st.lists(st.integers(0, 3), min_size=b, max_size=b))
    g = torch.Generator().manual_seed(seed)
    logp = torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3 - 1.0
    batch = {
        "logp": logp,
        "old": logp + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3,
        "ref": logp + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.2,
        "ent": torch.rand(b, t, generator=g, dtype=torch.float64),
        "adv": (torch.randn(b, 1, generator=g, dtype=torch.float64) * 2).expand(b, t).contiguous(),
        "mask": (torch.rand(b, t, generator=g) > 0.3).double(),
    }
    batch["rollout"] = batch["old"] + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
    batch["mask"][0, 0] = 1.0  # at least one loss token in the mini-batch
    settings = LossSettings(agg_mode=mode, norm_len=5, dual_clip_c=2.0, kl_beta=0.1, entropy_coeff=0.01,
                            policy_loss=policy_loss, tis=tis, gspo_clip_low=0.1, gspo_clip_high=0.15,
                            seq_mask_low=0.8, seq_mask_high=1.25, token_mask_low=0.7, token_mask_high=1.4)  # fmt: skip
    return batch, settings, parts


def part_gradient(batch, settings, rows):
    """(d numerator / d logp over the whole batch, denominator) of the given rows only."""
    logp = batch["logp"].clone().requires_grad_()
    pick = torch.tensor(rows, dtype=torch.long)
    num, den, _ = dapo_loss(
        logp[pick],
        batch["old"][pick],
        batch["adv"][pick],
        batch["mask"][pick],
        settings,
        entropy_BT=batch["ent"][pick],
        ref_logprobs_BT=batch["ref"][pick],
        rollout_logprobs_BT=batch["rollout"][pick],
    )
    (grad,) = torch.autograd.grad(num, logp, allow_unused=True)
    return (grad if grad is not None else torch.zeros_like(logp)), den.detach()


def whole_gradient(batch, settings):
    grad, den = part_gradient(batch, settings, list(range(batch["logp"].shape[0])))
    return grad / den
