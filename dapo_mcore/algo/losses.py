"""DAPO's clipped policy loss with every option users configure in the peers, as one pure function.

Per token, with r = exp(logp - logp_old), the policy term of `policy_loss` (each from its paper):
    dapo   pg = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))        clip-higher (arXiv 2503.14476 eq. 8, 10)
           pg = min(pg, -A c) where A < 0                                 dual-clip (c = dual_clip_c)
    gspo   pg = max(-A s, -A clip(s, 1 - eps_low, 1 + eps_high))          arXiv 2507.18071, its token form
           s_it = sg(s_i) exp(logp_it - sg(logp_it)), s_i = exp(mean_t m (logp - logp_old)) over sequence i
    cispo  pg = -sg(clip(r, 1 - eps_low, 1 + eps_high)) A logp            arXiv 2506.13585 eq. 4-5
    sapo   pg = -(4 / tau) sigmoid(tau (r - 1)) A, tau = tau_pos (A > 0) else tau_neg   arXiv 2511.20347
then, with w = exp(logp_old - logp_rollout) (the train/inference mismatch, detached):
    pg  *= min(w_it, tis_cap)                                              truncated IS, tis="token"
    pg  *= min(prod_t w_it, tis_cap) of the token's sequence               sequence TIS, tis="sequence"
    pg  *= min(exp(mean_t log w_it), tis_cap) of the token's sequence      tis="sequence_geometric"
    pg  *= w_it if low <= w_it <= high else 0 (stays in the denominator)  IcePop, tis="icepop"
    loss = pg + kl_beta * KL(logp, logp_ref) - entropy_coeff * H
Tokens of a sequence whose geometric-mean weight leaves [seq_mask_low, seq_mask_high] are masked
(tis="sequence_mask"); tokens whose own weight leaves [token_mask_low, token_mask_high] are (tis="token_reject",
verl's token rejection: out of the denominator too; tis="icepop" weights them 0 instead, Ring-1T's IcePop).
GSPO's value s_i is the same for every token of a sequence, and its gradient is
s_i / |y_i| x sum_t grad logp_it under seq-mean-token-mean: the paper's sequence-level GSPO, which verl's
"gspo" aggregates so; with per-token advantages it is the paper's GSPO-token.

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
and entropy only (the TIS weights and masks come from old and rollout log-probs, detached), for every policy loss
but gspo, whose s_i needs the whole sequence's log-probs (`needs_whole_sequences`: its gradient is autograd's,
unfused). So the numerator's gradient is per token and known as soon as the token's log-prob is (`token_loss_grad`): the
fused log-prob head applies it inside its forward chunk loop instead of recomputing logits in backward.
There is one definition of l_it, `token_losses`: `dapo_loss` aggregates it, and `token_loss_grad` takes its
gradient by autograd (a few elementwise ops per token), so the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dapo_mcore.config.schema import PAPERS_LOSS_AGG, AlgorithmConfig, SamplingConfig

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("kl", "abs", "mse", "low_var_kl")
TIS_MODES = ("none", "token", "sequence", "sequence_geometric", "sequence_mask", "token_reject", "icepop")
# The aggregation a policy loss takes when algorithm.loss_agg is "auto" (its paper's); the others: token-mean.
POLICY_LOSS_AGG = PAPERS_LOSS_AGG
POLICY_LOSSES = ("dapo", "gspo", "cispo", "sapo")
_GSPO_LOG_RATIO_MAX = 10.0  # verl's cap of GSPO's log sequence ratio
_LOG_RATIO_CLAMP = 20.0  # exp(20) ~ 5e8: keeps ratios finite when log-probs drift apart


def _whole(partial_sums: torch.Tensor) -> torch.Tensor:
    return partial_sums


@dataclass(frozen=True)
class SequenceShards:
    """Where a sequence's tokens are spread over ranks (context parallelism, docs/design/context_parallel.md
    section 5): every per-sequence sum of the loss (token counts, GSPO's log-ratio, sequence TIS / masks) and the
    early-stop guard's micro-batch sums go through `sum`, which totals detached partial sums (any shape, the same
    on every rank) over the ranks; `lead`: this rank counts the per-sequence and per-micro-batch quantities
    (sequences, masked sequences, skipped micro-batches), so that their sums over the ranks count each once.
    algo/ stays pure: the caller passes the reduction in (the actor: an all-reduce over its CP group)."""

    sum: Callable[[torch.Tensor], torch.Tensor] = _whole
    lead: bool = True


WHOLE = SequenceShards()  # each sequence whole on this rank (no context parallelism)


def resolve_loss_agg(policy_loss: str, loss_agg: str) -> str:
    """algorithm.loss_agg as the loss uses it: "auto" is the policy loss's own (`POLICY_LOSS_AGG`)."""
    return POLICY_LOSS_AGG.get(policy_loss, "token-mean") if loss_agg == "auto" else loss_agg


# The defaults are the config schema's (one set of defaults: tests/unit/test_settings_defaults.py).
_ALGO = AlgorithmConfig()


@dataclass(frozen=True)
class LossSettings:
    clip_low: float = _ALGO.clip_low
    clip_high: float = _ALGO.clip_high
    dual_clip_c: float | None = _ALGO.dual_clip_c
    agg_mode: str = resolve_loss_agg(_ALGO.policy_loss, _ALGO.loss_agg)
    norm_len: int = _ALGO.loss_norm_len or SamplingConfig().max_response_len
    kl_beta: float = _ALGO.kl.beta
    kl_estimator: str = _ALGO.kl.estimator
    entropy_coeff: float = _ALGO.entropy_coeff
    tis: str = _ALGO.mismatch.tis
    tis_cap: float = _ALGO.mismatch.tis_cap
    seq_mask_low: float = _ALGO.mismatch.seq_mask_low
    seq_mask_high: float = _ALGO.mismatch.seq_mask_high
    early_stop_ratio: float | None = _ALGO.mismatch.early_stop_ratio
    token_mask_low: float = _ALGO.mismatch.token_mask_low
    token_mask_high: float = _ALGO.mismatch.token_mask_high
    policy_loss: str = _ALGO.policy_loss
    gspo_clip_low: float = _ALGO.gspo.clip_low
    gspo_clip_high: float = _ALGO.gspo.clip_high
    cispo_clip_low: float = _ALGO.cispo.clip_low
    cispo_clip_high: float = _ALGO.cispo.clip_high
    sapo_tau_pos: float = _ALGO.sapo.tau_pos
    sapo_tau_neg: float = _ALGO.sapo.tau_neg

    def __post_init__(self):
        for value, options, name in (
            (self.policy_loss, POLICY_LOSSES, "policy_loss"),
            (self.agg_mode, LOSS_AGG_MODES, "agg_mode"),
            (self.kl_estimator, KL_ESTIMATORS, "kl_estimator"),
            (self.tis, TIS_MODES, "tis"),
        ):
            if value not in options:
                raise ValueError(f"{name}={value!r}; expected one of {options}")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c must be > 1, got {self.dual_clip_c}")

    @property
    def needs_whole_sequences(self) -> bool:
        """A token's loss depends on its sequence's other log-probs (gspo): no per-token gradient in the head."""
        return self.policy_loss == "gspo"

    def ratio_band(self) -> tuple[float, float]:
        """The ratio range outside which the policy loss clips (its statistics count the tokens beyond)."""
        low, high = {
            "gspo": (self.gspo_clip_low, self.gspo_clip_high),
            "cispo": (self.cispo_clip_low, self.cispo_clip_high),
        }.get(self.policy_loss, (self.clip_low, self.clip_high))
        return 1.0 - low, 1.0 + high


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


def aggregate(
    loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str, norm_len: int = 1, shards: SequenceShards = WHOLE
):
    """(numerator, denominator) of the mini-batch loss for one micro-batch; see the module docstring. Under
    `shards` the numerator is this rank's share and the sequence count is the lead rank's."""
    masked = loss_BT * mask_BT
    if mode == "token-mean":
        return masked.sum(), mask_BT.sum()
    tokens_B = shards.sum(mask_BT.detach().sum(dim=-1))
    n_seqs = (tokens_B > 0).to(loss_BT.dtype).sum() * float(shards.lead)
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
    shards: SequenceShards = WHOLE,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(numerator, denominator, statistic sums) of one micro-batch. Rows are sequences, columns tokens; under
    `shards` (context parallelism) this rank's tokens of each sequence, the per-sequence sums totalled over the
    ranks, so that the ranks' numerators, denominators and statistics add up to the whole micro-batch's."""
    mask = mask_BT.to(logprobs_BT.dtype)
    seq_log_ratio = _sequence_log_ratio(logprobs_BT, old_logprobs_BT, mask, shards) if s.needs_whole_sequences else None
    ratio = _ratio(logprobs_BT, old_logprobs_BT) if seq_log_ratio is None else seq_log_ratio.exp()
    stats = _clip_stats(ratio, advantages_BT, mask, s)
    tis_weight = None
    if s.tis != "none":
        tis_weight, mask = _mismatch_correction(mask, old_logprobs_BT, rollout_logprobs_BT, s, stats, shards)
    loss = token_losses(
        logprobs_BT, old_logprobs_BT, advantages_BT, s, tis_weight, ref_logprobs_BT, entropy_BT, seq_log_ratio
    )
    if s.kl_beta > 0.0:
        with torch.no_grad():
            stats["kl"] = (kl_penalty(logprobs_BT, ref_logprobs_BT, s.kl_estimator) * mask).sum()
    numerator, denominator = aggregate(loss, mask, s.agg_mode, s.norm_len, shards)
    if s.early_stop_ratio is not None:
        keep = micro_batch_keep(stats, s, shards).to(numerator.dtype)
        numerator, denominator = numerator * keep, denominator * keep
        stats["skipped_micro_batches"] = (1.0 - keep) * float(shards.lead)
    return numerator, denominator, stats


def token_losses(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    s: LossSettings,
    tis_weight: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    seq_log_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """l_it of every token (any shape, all arguments alike): the one definition of the per-token loss (module
    docstring), before masking and aggregation. `tis_weight`: the importance weights (tis="token", "sequence",
    "sequence_geometric" or "icepop"); `seq_log_ratio`: log s_i at each token of sequence i (gspo only,
    `_sequence_log_ratio`)."""
    pg = policy_term(logprobs, old_logprobs, advantages, s, seq_log_ratio)
    loss = pg if tis_weight is None else pg * tis_weight
    if s.kl_beta > 0.0:
        loss = loss + s.kl_beta * kl_penalty(logprobs, ref_logprobs, s.kl_estimator)
    if s.entropy_coeff > 0.0:
        loss = loss - s.entropy_coeff * entropy
    return loss


def policy_term(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    s: LossSettings,
    seq_log_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """pg_it of `s.policy_loss` (module docstring), any shape."""
    if s.policy_loss == "gspo":
        if seq_log_ratio is None:
            raise ValueError("policy_loss='gspo' needs the sequences' log ratios (it has no per-token gradient)")
        # value s_i, gradient s_i d logp_it: the token form of the sequence ratio
        log_s = (logprobs - logprobs.detach() + seq_log_ratio.detach()).clamp(max=_GSPO_LOG_RATIO_MAX)
        ratio = log_s.exp()
        low, high = s.ratio_band()
        return torch.maximum(-advantages * ratio, -advantages * ratio.clamp(low, high))
    ratio = _ratio(logprobs, old_logprobs)
    if s.policy_loss == "cispo":
        low, high = s.ratio_band()
        return -ratio.clamp(max(low, 0.0), high).detach() * advantages * logprobs
    if s.policy_loss == "sapo":
        tau = torch.full_like(ratio, s.sapo_tau_neg).masked_fill(advantages > 0, s.sapo_tau_pos)
        return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * advantages
    pg = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1.0 - s.clip_low, 1.0 + s.clip_high))
    if s.dual_clip_c is not None:
        pg = torch.where(advantages < 0, torch.minimum(pg, -advantages * s.dual_clip_c), pg)
    return pg


def _sequence_log_ratio(
    logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor, shards: SequenceShards = WHOLE
):
    """[B, T]: log s_i (GSPO's length-normalised sequence ratio, from the log-probs without their gradient) at
    every token of row i."""
    log_ratio = (logprobs_BT.detach() - old_logprobs_BT).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    mask_BT = mask_BT.detach()
    sums_2B = shards.sum(torch.stack([(log_ratio * mask_BT).sum(dim=-1), mask_BT.sum(dim=-1)]))
    seq_B = sums_2B[0] / sums_2B[1].clamp(min=1)
    return seq_B.unsqueeze(-1).expand_as(logprobs_BT)


def _ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    return (logprobs - old_logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP).exp()


def micro_batch_keep(stats: dict[str, torch.Tensor], s: LossSettings, shards: SequenceShards = WHOLE) -> torch.Tensor:
    """1, or 0 for a micro-batch the early-stop guard drops: its mean ratio over loss tokens is too high (over
    the whole micro-batch: `shards` totals the ranks' sums, so they all keep or all drop it).

    A constant for autograd (the statistics are taken without gradient), so it scales the gradient too.
    """
    if s.early_stop_ratio is None:
        return torch.ones((), dtype=stats["tokens"].dtype, device=stats["tokens"].device)
    ratio, tokens = shards.sum(torch.stack([stats["ratio"], stats["tokens"]]).detach())
    return ((ratio / tokens.clamp(min=1)) <= s.early_stop_ratio).to(stats["tokens"].dtype)


def _clip_stats(ratio, adv, mask, s: LossSettings) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        low, high = s.ratio_band()
        above, below = ratio > high, ratio < low
        pos, neg = adv > 0, adv < 0
        stats = {
            "tokens": mask.sum(),
            "ratio": (ratio * mask).sum(),
            "clip_high": ((above & pos) * mask).sum(),  # clipped: no gradient
            "clip_low": ((below & neg) * mask).sum(),  # clipped: no gradient
            "above_high_neg_adv": ((above & neg) * mask).sum(),  # outside the range, still trained
            "below_low_pos_adv": ((below & pos) * mask).sum(),
        }
        if s.dual_clip_c is not None and s.policy_loss == "dapo":
            stats["dual_clip"] = ((ratio > s.dual_clip_c) & neg).to(mask.dtype).mul(mask).sum()
    return stats


def _mismatch_correction(mask, old_logprobs, rollout_logprobs, s: LossSettings, stats, shards=WHOLE):
    """Train/inference mismatch, from the trainer's old policy over the rollout engine's: (truncated importance
    weights or None, the mask with sequences outside the band dropped)."""
    log_w = _mismatch_log_weights(old_logprobs, rollout_logprobs, s)
    if s.tis in ("token", "sequence", "sequence_geometric"):
        if s.tis == "sequence":  # each token takes its sequence's product of weights
            log_w = shards.sum((log_w * mask).sum(dim=-1)).unsqueeze(-1).expand_as(log_w)
        elif s.tis == "sequence_geometric":  # each token takes its sequence's geometric-mean weight
            sums_2B = shards.sum(torch.stack([(log_w * mask).sum(dim=-1), mask.detach().sum(dim=-1)]))
            log_w = (sums_2B[0] / sums_2B[1].clamp(min=1)).unsqueeze(-1).expand_as(log_w)
        weight = _tis_weight(log_w, s)
        stats["tis_weight"] = (weight * mask).sum()
        stats["tis_truncated"] = ((log_w.exp() > s.tis_cap) * mask).sum()
        return weight, mask
    if s.tis in ("token_reject", "icepop"):  # the tokens whose weight leaves the band
        w = log_w.exp()
        inside_BT = ((w >= s.token_mask_low) & (w <= s.token_mask_high)).to(mask.dtype)
        stats["token_masked"] = (mask * (1.0 - inside_BT)).sum()
        if s.tis == "token_reject":  # no gradient and out of the denominator (verl's token rejection)
            return None, mask * inside_BT
        weight = w * inside_BT  # IcePop: weighted by w inside the band, 0 outside, in the denominator
        stats["tis_weight"] = (weight * mask).sum()
        return weight, mask
    sums_2B = shards.sum(torch.stack([(log_w * mask).sum(dim=-1), mask.detach().sum(dim=-1)]))
    inside = _sequences_inside(sums_2B[0], sums_2B[1], s)
    has_tokens = sums_2B[1] > 0
    stats["seq_masked"] = (~inside & has_tokens).to(mask.dtype).sum() * float(shards.lead)
    return None, mask * inside.to(mask.dtype).unsqueeze(-1)


def _mismatch_log_weights(old_logprobs, rollout_logprobs, s: LossSettings) -> torch.Tensor:
    if rollout_logprobs is None:
        raise ValueError(f"tis={s.tis!r} needs the rollout engine's log-probs")
    return (old_logprobs - rollout_logprobs).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP).detach()


def _tis_weight(log_w: torch.Tensor, s: LossSettings) -> torch.Tensor:
    return log_w.exp().clamp(max=s.tis_cap)


def _sequences_inside(log_w_sum_B: torch.Tensor, tokens_B: torch.Tensor, s: LossSettings) -> torch.Tensor:
    """[B] bool: the sequence's geometric-mean train/rollout ratio (from its sum of log weights over its loss
    tokens) lies in [seq_mask_low, seq_mask_high]."""
    seq_log_w_B = log_w_sum_B / tokens_B.clamp(min=1)
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
    tis_weight: torch.Tensor | None  # importance weights (tis="token", "sequence", "sequence_geometric", "icepop")
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
    shards: SequenceShards = WHOLE,
) -> TokenLossTerms:
    """The per-token constants of `dapo_loss` with these arguments (known before the forward pass)."""
    mask = mask_BT.to(old_logprobs_BT.dtype)
    weight = None
    if s.tis != "none":
        weight, mask = _mismatch_correction(mask, old_logprobs_BT, rollout_logprobs_BT, s, {}, shards)
    return TokenLossTerms(
        old_logprobs=old_logprobs_BT,
        advantages=advantages_BT,
        agg_weight=_aggregation_weights(mask, s.agg_mode, s.norm_len, shards),
        tis_weight=weight,
        ref_logprobs=ref_logprobs_BT if s.kl_beta > 0.0 else None,
    )


def _aggregation_weights(
    mask_BT: torch.Tensor, mode: str, norm_len: int, shards: SequenceShards = WHOLE
) -> torch.Tensor:
    """d numerator / d loss_it of `aggregate`: a function of the mask alone."""
    if mode in ("token-mean", "seq-mean-token-sum"):
        return mask_BT
    if mode == "seq-mean-token-mean":
        return mask_BT / shards.sum(mask_BT.sum(dim=-1)).clamp(min=1).unsqueeze(-1)
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
    shards: SequenceShards = WHOLE,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """d numerator / d logprobs_BT and d numerator / d entropy_BT (None: no entropy term) of `dapo_loss` with
    the same arguments, guard included. (The entropy's value does not enter: the loss is linear in it.)"""
    if s.needs_whole_sequences:  # no per-token form: autograd through the loss itself
        return _autograd_of_loss(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, s, shards=shards,
                                 ref_logprobs_BT=ref_logprobs_BT, rollout_logprobs_BT=rollout_logprobs_BT)  # fmt: skip
    terms = token_loss_terms(
        old_logprobs_BT,
        advantages_BT,
        mask_BT,
        s,
        ref_logprobs_BT=ref_logprobs_BT,
        rollout_logprobs_BT=rollout_logprobs_BT,
        shards=shards,
    )
    d_logprobs, d_entropy = token_loss_grad(logprobs_BT, terms, s)
    if s.early_stop_ratio is None:
        return d_logprobs, d_entropy
    ratio = _ratio(logprobs_BT, old_logprobs_BT)
    keep = micro_batch_keep(_clip_stats(ratio, advantages_BT, mask_BT.to(ratio.dtype), s), s, shards)
    return d_logprobs * keep, None if d_entropy is None else d_entropy * keep


def _autograd_of_loss(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT, s: LossSettings, **given):
    with torch.enable_grad():
        logp = logprobs_BT.detach().requires_grad_()
        entropy = torch.zeros_like(logp, requires_grad=True) if s.entropy_coeff > 0.0 else None
        numerator, _, _ = dapo_loss(logp, old_logprobs_BT, advantages_BT, mask_BT, s, entropy_BT=entropy, **given)
        grads = torch.autograd.grad(numerator, (logp,) if entropy is None else (logp, entropy))
    return grads[0], grads[1] if entropy is not None else None


def stat_keys(s: LossSettings) -> tuple[str, ...]:
    """The statistic sums dapo_loss returns for these settings, in a fixed order (for all-reduces)."""
    keys = ["tokens", "ratio", "clip_high", "clip_low", "above_high_neg_adv", "below_low_pos_adv"]
    keys += ["dual_clip"] if s.dual_clip_c is not None and s.policy_loss == "dapo" else []
    keys += {"token": ["tis_weight", "tis_truncated"], "sequence": ["tis_weight", "tis_truncated"],
             "sequence_geometric": ["tis_weight", "tis_truncated"], "sequence_mask": ["seq_masked"],
             "token_reject": ["token_masked"], "icepop": ["tis_weight", "token_masked"], "none": []}[s.tis]  # fmt: skip
    keys += ["kl"] if s.kl_beta > 0.0 else []
    keys += ["skipped_micro_batches"] if s.early_stop_ratio is not None else []
    return tuple(keys)
