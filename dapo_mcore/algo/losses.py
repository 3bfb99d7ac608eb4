"""DAPO's clipped token-level policy loss (paper eq. 8 with clip-higher, eq. 10).

The loss is returned as an unnormalised sum with its token count (DESIGN.md rule 1): Megatron's
`calculate_per_token_loss=True` sums the counts over micro-batches and data-parallel ranks and divides the
gradient by the total, so the objective's 1 / sum_i |o_i| runs over the whole mini-batch however it is
split. Clip statistics are returned as counts for the same reason.
"""

from __future__ import annotations

import torch


def clipped_policy_loss(
    logprobs_T: torch.Tensor,
    old_logprobs_T: torch.Tensor,
    advantages_T: torch.Tensor,
    mask_T: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Sum over masked tokens of -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), and the token count.

    Counts: `clip_high` = tokens with A > 0 and r > 1 + clip_high (upper clip active, no gradient);
    `clip_low` = tokens with A < 0 and r < 1 - clip_low (lower clip active, no gradient).
    """
    ratio_T = torch.exp(logprobs_T - old_logprobs_T)
    unclipped_T = -advantages_T * ratio_T
    clipped_T = -advantages_T * ratio_T.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_T = torch.maximum(unclipped_T, clipped_T)
    mask_T = mask_T.to(loss_T.dtype)
    with torch.no_grad():
        counts = {
            "clip_high": (((ratio_T > 1.0 + clip_high) & (advantages_T > 0)) * mask_T).sum(),
            "clip_low": (((ratio_T < 1.0 - clip_low) & (advantages_T < 0)) * mask_T).sum(),
            "ratio": (ratio_T * mask_T).sum(),
        }
    return (loss_T * mask_T).sum(), mask_T.sum(), counts
