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

Every mode is sum_it c_it l_it with c_it a constant of the mask, and l_it depends on its own token's log-prob
and entropy only (the TIS weights and sequence masks come from old and rollout log-probs, detached). So the
numerator's gradient is per token and known as soon as the token's log-prob is (`token_loss_grad`): the
fused log-prob head applies it inside its forward chunk loop instead of recomputing logits in backward.
There is one definition of l_it, `token_losses`: `dapo_loss` aggregates it, and `token_loss_grad` takes its
gradient by autograd (a few elementwise ops per token), so the two cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dapo_mcore.config.schema import AlgorithmConfig, SamplingConfig

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("kl", "abs", "mse", "low_var_kl")
TIS_MODES = ("none", "token", "sequence_mask")
_LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: keeps ratios finite when log-probs drift apart


# The defaults are the config schema's (one set of defaults: tests/unit/test_settings_defaults.py).
_ALGO = AlgorithmConfig()


@dataclass(frozen=True)
class LossSettings:
    clip_low: float = _ALGO.clip_low
    clip_high: float = _ALGO.clip_high
    dual_clip_c: float | None = _ALGO.dual_clip_c
    agg_mode: str = _ALGO.loss_agg
    norm_len: int = _ALGO.loss_norm_len or SamplingConfig().max_response_len
    kl_beta: float = _ALGO.kl.beta
    kl_estimator: str = _ALGO.kl.estimator
    entropy_coeff: float = _ALGO.entropy_coeff
    tis: str = _ALGO.mismatch.tis
    tis_cap: float = _ALGO.mismatch.tis_cap
    seq_mask_low: float = _ALGO.mismatch.seq_mask_low
    seq_mask_high: float = _ALGO.mismatch.seq_mask_high
    early_stop_ratio: float | None = _ALGO.mismatch.early_stop_ratio

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
    ratio = _ratio(logprobs_BT, old_logprobs_BT)
    stats = _clip_stats(ratio, advantages_BT, mask, s)
    tis_weight = None
    if s.tis != "none":
        tis_weight, mask = _mismatch_correction(mask, old_logprobs_BT, rollout_logprobs_BT, s, stats)
    loss = token_losses(logprobs_BT, old_logprobs_BT, advantages_BT, s, tis_weight, ref_logprobs_BT, entropy_BT)
    if s.kl_beta > 0.0:
        with torch.no_grad():
            stats["kl"] = (kl_penalty(logprobs_BT, ref_logprobs_BT, s.kl_estimator) * mask).sum()
    numerator, denominator = aggregate(loss, mask, s.agg_mode, s.norm_len)
    if s.early_stop_ratio is not None:
        keep = micro_batch_keep(stats, s).to(numerator.dtype)
        numerator, denominator = numerator * keep, denominator * keep
        stats["skipped_micro_batches"] = 1.0 - keep
    return numerator, denominator, stats


def token_losses(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    s: LossSettings,
    tis_weight: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> torch.Tensor:
    """l_it of every token (any shape, all arguments alike): the one definition of the per-token loss (module
    docstring), before masking and aggregation. `tis_weight`: the truncated importance weights (tis="token")."""
    ratio = _ratio(logprobs, old_logprobs)
    pg = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1.0 - s.clip_low, 1.0 + s.clip_high))
    if s.dual_clip_c is not None:
        pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * s.dual_clip_c), pg)
    loss = pg if tis_weight is None else pg * tis_weight
    if s.kl_beta > 0.0:
        loss = loss + s.kl_beta * kl_penalty(logprobs, ref_logprobs, s.kl_estimator)
    if s.entropy_coeff > 0.0:
        loss = loss - s.entropy_coeff * entropy
    return loss


def _ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    return (logprobs - old_logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP).exp()


def micro_batch_keep(stats: dict[str, torch.Tensor], s: LossSettings) -> torch.Tensor:
    """1, or 0 for a micro-batch the early-stop guard drops: its mean ratio over loss tokens is too high.

    A constant for autograd (the statistics are taken without gradient), so it scales the gradient too.
    """
    if s.early_stop_ratio is None:
        return torch.ones((), dtype=stats["tokens"].dtype, device=stats["tokens"].device)
    return ((stats["ratio"] / stats["tokens"].clamp(min=1)) <= s.early_stop_ratio).to(stats["tokens"].dtype)


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


def _mismatch_correction(mask, old_logprobs, rollout_logprobs, s: LossSettings, stats):
    """Train/inference mismatch, from the trainer's old policy over the rollout engine's: (truncated importance
    weights or None, the mask with sequences outside the band dropped)."""
    log_w = _mismatch_log_weights(old_logprobs, rollout_logprobs, s)
    if s.tis == "token":
        weight = _tis_weight(log_w, s)
        stats["tis_weight"] = (weight * mask).sum()
        stats["tis_truncated"] = ((log_w.exp() > s.tis_cap) * mask).sum()
        return weight, mask
    inside = _sequences_inside(log_w, mask, s)
    has_tokens = mask.sum(dim=-1) > 0
    stats["seq_masked"] = (~inside & has_tokens).to(mask.dtype).sum()
    return None, mask * inside.to(mask.dtype).unsqueeze(-1)


def _mismatch_log_weights(old_logprobs, rollout_logprobs, s: LossSettings) -> torch.Tensor:
    if rollout_logprobs is None:
        raise ValueError(f"tis={s.tis!r} needs the rollout engine's log-probs")
    return (old_logprobs - rollout_logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP).detach()


def _tis_weight(log_w: torch.Tensor, s: LossSettings) -> torch.Tensor:
    return log_w.exp().clamp(max=s.tis_cap)


def _sequences_inside(log_w_BT: torch.Tensor, mask_BT: torch.Tensor, s: LossSettings) -> torch.Tensor:
    """[B] bool: the sequence's geometric-mean train/rollout ratio lies in [seq_mask_low, seq_mask_high]."""
    seq_log_w_B = (log_w_BT * mask_BT).sum(dim=-1) / mask_BT.sum(dim=-1).clamp(min=1)
    return (seq_log_w_B.exp() >= s.seq_mask_low) & (seq_log_w_B.exp() <= s.seq_mask_high)


# ---- the numerator's gradient per token -----------------------------------------------------------------
@dataclass(frozen=True)
class TokenLossTerms:
    """Everything the gradient of one token's loss needs besides its log-prob: constants of the micro-batch.

    Tensors have the tokens' shape: [B, T] from `token_loss_terms`, any other after `take`.
    """

    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    agg_weight: torch.Tensor  # d numerator / d l_it: aggregation coefficient x mask
    tis_weight: torch.Tensor | None  # truncated importance weights (tis="token")
    ref_logprobs: torch.Tensor | None

    def take(self, index) -> TokenLossTerms:
        """The terms of the tokens `index` selects (an index tuple, a mask or a slice)."""
        return TokenLossTerms(*(None if t is None else t[index] for t in vars(self).values()))


def token_loss_terms(
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    s: LossSettings,
    *,
    ref_logprobs_BT: torch.Tensor | None = None,
    rollout_logprobs_BT: torch.Tensor | None = None,
) -> TokenLossTerms:
    """The per-token constants of `dapo_loss` with these arguments (known before the forward pass)."""
    mask = mask_BT.to(old_logprobs_BT.dtype)
    weight = None
    if s.tis != "none":
        weight, mask = _mismatch_correction(mask, old_logprobs_BT, rollout_logprobs_BT, s, stats={})
    return TokenLossTerms(
        old_logprobs=old_logprobs_BT,
        advantages=advantages_BT,
        agg_weight=_aggregation_weights(mask, s.agg_mode, s.norm_len),
        tis_weight=weight,
        ref_logprobs=ref_logprobs_BT if s.kl_beta > 0.0 else None,
    )


def _aggregation_weights(mask_BT: torch.Tensor, mode: str, norm_len: int) -> torch.Tensor:
    """d numerator / d loss_it of `aggregate`: a function of the mask alone."""
    if mode in ("token-mean", "seq-mean-token-sum"):
        return mask_BT
    if mode == "seq-mean-token-mean":
        return mask_BT / mask_BT.sum(dim=-1, keepdim=True).clamp(min=1)
    if mode == "seq-mean-token-sum-norm":
        return mask_BT / norm_len
    raise ValueError(f"unknown loss aggregation {mode!r}")


def token_loss_grad(
    logprobs: torch.Tensor, terms: TokenLossTerms, s: LossSettings
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(d numerator / d logprobs, d numerator / d entropy or None when the loss has no entropy term), token by
    token, before the early-stop guard's factor (`micro_batch_keep`). Any shape, the terms' shape. Autograd
    through `token_losses` (the numerator is sum_it agg_weight_it l_it), wherever it is called from."""
    with torch.enable_grad():
        logp = logprobs.detach().requires_grad_()
        entropy = torch.zeros_like(logp, requires_grad=True) if s.entropy_coeff > 0.0 else None
        loss = token_losses(
            logp, terms.old_logprobs, terms.advantages, s, terms.tis_weight, terms.ref_logprobs, entropy
        )
        inputs = (logp,) if entropy is None else (logp, entropy)
        grads = torch.autograd.grad(loss, inputs, grad_outputs=terms.agg_weight.to(loss.dtype))
    return grads[0], grads[1] if entropy is not None else None


def dapo_loss_grad(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    s: LossSettings,
    *,
    ref_logprobs_BT: torch.Tensor | None = None,
    rollout_logprobs_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """d numerator / d logprobs_BT and d numerator / d entropy_BT (None: no entropy term) of `dapo_loss` with
    the same arguments, guard included. (The entropy's value does not enter: the loss is linear in it.)"""
    terms = token_loss_terms(
        old_logprobs_BT,
        advantages_BT,
        mask_BT,
        s,
        ref_logprobs_BT=ref_logprobs_BT,
        rollout_logprobs_BT=rollout_logprobs_BT,
    )
    d_logprobs, d_entropy = token_loss_grad(logprobs_BT, terms, s)
    if s.early_stop_ratio is None:
        return d_logprobs, d_entropy
    ratio = _ratio(logprobs_BT, old_logprobs_BT)
    keep = micro_batch_keep(_clip_stats(ratio, advantages_BT, mask_BT.to(ratio.dtype), s), s)
    return d_logprobs * keep, None if d_entropy is None else d_entropy * keep


def stat_keys(s: LossSettings) -> tuple[str, ...]:
    """The statistic sums dapo_loss returns for these settings, in a fixed order (for all-reduces)."""
    keys = ["tokens", "ratio", "clip_high", "clip_low", "above_high_neg_adv", "below_low_pos_adv"]
    keys += ["dual_clip"] if s.dual_clip_c is not None else []
    keys += {"token": ["tis_weight", "tis_truncated"], "sequence_mask": ["seq_masked"], "none": []}[s.tis]
    keys += ["kl"] if s.kl_beta > 0.0 else []
    keys += ["skipped_micro_batches"] if s.early_stop_ratio is not None else []
    return tuple(keys)
