"""DAPO's clipped policy loss with every option users configure in the peers, as one pure function.

Per token (DAPO eq. 8, 10), with r = exp(logp - logp_old):
    pg   = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))             clip-higher
    pg   = min(pg, -A c) where A < 0                                       dual-clip (c = dual_clip_c)
    pg  *= min(exp(logp_old - logp_rollout), tis_cap)                      truncated IS, tis="token"
    loss = pg + kl_beta * KL(logp, logp_ref) - entropy_coeff * H
Tokens of a sequence whose geometric-mean train/rollout ratio leaves [seq_mask_low, seq_mask_high] are masked
(tis="sequence_mask").

Aggregation over a mini-batch of B sequences with m_it the loss mask (DESIGN.md rule 1: returned as a
numerator and a denominator; Megatron's `calculate_per_token_loss` sums both over micro-batches and
data-parallel ranks and divides the gradient by the total, so every mode is defined over the whole
mini-batch, whatever its split):
    token-mean               sum_it m l / sum_it m
    seq-mean-token-mean      sum_i (sum_t m l / sum_t m) / B'        B' = sequences with a loss token
    seq-mean-token-sum       sum_it m l / B'
    seq-mean-token-sum-norm  sum_it m l / (B' * norm_len)             Dr.GRPO's constant divisor

Guard (RLinf's early_stop_imp_ratio): a micro-batch whose mean ratio over its loss tokens exceeds
`early_stop_ratio` contributes neither loss nor denominator. Statistics come back as sums, never .item().
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("kl", "abs", "mse", "low_var_kl")
TIS_MODES = ("none", "token", "sequence_mask")
_LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: keeps ratios finite when log-probs drift apart


@dataclass(frozen=True)
class LossSettings:
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip_c: float | None = None
    agg_mode: str = "token-mean"
    norm_len: int = 1
    kl_beta: float = 0.0
    kl_estimator: str = "low_var_kl"
    entropy_coeff: float = 0.0
    tis: str = "none"
    tis_cap: float = 2.0
    seq_mask_low: float = 0.5
    seq_mask_high: float = 2.0
    early_stop_ratio: float | None = None

    def __post_init__(self):
        for value, options, name in (
            (self.agg_mode, LOSS_AGG_MODES, "agg_mode"),
            (self.kl_estimator, KL_ESTIMATORS, "kl_estimator"),
            (self.tis, TIS_MODES, "tis"),
        ):
            if value not in options:
                raise ValueError(f"{name}={value!r}; expected one of {options}")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1, got {self.dual_clip_c}")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimates from the sampled token's log-probs (Schulman's k1/k2/k3)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "kl":
        return log_ratio
    if estimator == "abs":
        return log_ratio.abs()
    if estimator == "mse":
        return 0.5 * log_ratio.square()
    if estimator == "low_var_kl":  # k3 = exp(-x) + x - 1 with x = logp - logp_ref, clamped as in RLinf/verl
        neg = (-log_ratio).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return (neg.exp() - neg - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {estimator!r}")


def aggregate(loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str, norm_len: int = 1):
    """(numerator, denominator) of the mini-batch loss for one micro-batch; see the module docstring."""
    masked = loss_BT * mask_BT
    if mode == "token-mean":
        return masked.sum(), mask_BT.sum()
    tokens_B = mask_BT.sum(dim=-1)
    n_seqs = (tokens_B > 0).to(loss_BT.dtype).sum()
    if mode == "seq-mean-token-mean":
        return (masked.sum(dim=-1) / tokens_B.clamp(min=1)).sum(), n_seqs
    if mode == "seq-mean-token-sum":
        return masked.sum(), n_seqs
    if mode == "seq-mean-token-sum-norm":
        return masked.sum() / norm_len, n_seqs
    raise ValueError(f"unknown loss aggregation {mode!r}")


def dapo_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    s: LossSettings,
    *,
    entropy_BT: torch.Tensor | None = None,
    ref_logprobs_BT: torch.Tensor | None = None,
    rollout_logprobs_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(numerator, denominator, statistic sums) of one micro-batch. Rows are sequences, columns tokens."""
    mask = mask_BT.to(logprobs_BT.dtype)
    log_ratio = (logprobs_BT - old_logprobs_BT).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()
    adv = advantages_BT
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - s.clip_low, 1.0 + s.clip_high))
    if s.dual_clip_c is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * s.dual_clip_c), pg)
    stats = _clip_stats(ratio, adv, mask, s)
    if s.tis != "none":
        pg, mask = _mismatch_correction(pg, mask, old_logprobs_BT, rollout_logprobs_BT, s, stats)
    loss = pg
    if s.kl_beta > 0.0:
        kl = kl_penalty(logprobs_BT, ref_logprobs_BT, s.kl_estimator)
        loss = loss + s.kl_beta * kl
        stats["kl"] = (kl.detach() * mask).sum()
    if s.entropy_coeff > 0.0:
        loss = loss - s.entropy_coeff * entropy_BT
    numerator, denominator = aggregate(loss, mask, s.agg_mode, s.norm_len)
    if s.early_stop_ratio is not None:
        keep = ((stats["ratio"] / stats["tokens"].clamp(min=1)) <= s.early_stop_ratio).to(numerator.dtype)
        numerator, denominator = numerator * keep, denominator * keep
        stats["skipped_micro_batches"] = 1.0 - keep
    return numerator, denominator, stats


def _clip_stats(ratio, adv, mask, s: LossSettings) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        above, below = ratio > 1.0 + s.clip_high, ratio < 1.0 - s.clip_low
        pos, neg = adv > 0, adv < 0
        stats = {
            "tokens": mask.sum(),
            "ratio": (ratio * mask).sum(),
            "clip_high": ((above & pos) * mask).sum(),  # clipped: no gradient
            "clip_low": ((below & neg) * mask).sum(),  # clipped: no gradient
            "above_high_neg_adv": ((above & neg) * mask).sum(),  # outside the range, still trained
            "below_low_pos_adv": ((below & pos) * mask).sum(),
        }
        if s.dual_clip_c is not None:
            stats["dual_clip"] = ((ratio > s.dual_clip_c) & neg).to(mask.dtype).mul(mask).sum()
    return stats


def _mismatch_correction(pg, mask, old_logprobs, rollout_logprobs, s: LossSettings, stats):
    """Train/inference mismatch: importance weights of the trainer's old policy over the rollout engine's."""
    if rollout_logprobs is None:
        raise ValueError(f"tis={s.tis!r} needs the rollout engine's log-probs")
    log_w = (old_logprobs - rollout_logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP).detach()
    if s.tis == "token":
        weight = log_w.exp().clamp(max=s.tis_cap)
        stats["tis_weight"] = (weight * mask).sum()
        stats["tis_truncated"] = ((log_w.exp() > s.tis_cap) * mask).sum()
        return pg * weight, mask
    seq_log_w = (log_w * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)  # geometric mean per sequence
    inside = (seq_log_w.exp() >= s.seq_mask_low) & (seq_log_w.exp() <= s.seq_mask_high)
    has_tokens = mask.sum(dim=-1) > 0
    stats["seq_masked"] = (~inside & has_tokens).to(mask.dtype).sum()
    return pg, mask * inside.to(mask.dtype).unsqueeze(-1)


def stat_keys(s: LossSettings) -> tuple[str, ...]:
    """The statistic sums dapo_loss returns for these settings, in a fixed order (for all-reduces)."""
    keys = ["tokens", "ratio", "clip_high", "clip_low", "above_high_neg_adv", "below_low_pos_adv"]
    keys += ["dual_clip"] if s.dual_clip_c is not None else []
    keys += {"token": ["tis_weight", "tis_truncated"], "sequence_mask": ["seq_masked"], "none": []}[s.tis]
    keys += ["kl"] if s.kl_beta > 0.0 else []
    keys += ["skipped_micro_batches"] if s.early_stop_ratio is not None else []
    return tuple(keys)
