"""algorithm.policy_loss (gspo, cispo, sapo) and algorithm.mismatch.tis (sequence, sequence_geometric, token_reject,
icepop) against references
written from the papers' equations, token by token in Python floats (float64): the numerator, the denominator and
the numerator's gradient of `dapo_loss` on random cases, for every aggregation and rollout correction.

GSPO (arXiv 2507.18071): s_i = exp(1/|y_i| sum_t log(pi/pi_old)), its token form's gradient is s_i A grad logp_it
per token, unless the clip is active. CISPO (arXiv 2506.13585 eq. 4-5): -sg(clip(r)) A logp. SAPO (arXiv
2511.20347): -(4/tau) sigmoid(tau (r - 1)) A, tau = tau_pos where A > 0 else tau_neg, whose derivative in logp is
-4 sigma (1 - sigma) r A.

IcePop (Ring-1T, arXiv 2510.18855): each token's term times M(k) = k if alpha <= k <= beta else 0, with
k = pi_train / pi_infer, the denominator unchanged. Token rejection (verl's rollout_rs=token_k1): tokens whose
k leaves [alpha, beta] leave the loss and its denominator. Geometric-mean sequence TIS: every token of sequence i
weighted by min(exp(1/|y_i| sum_t log k_it), cap)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from dapo_mcore.algo.losses import LOSS_AGG_MODES, LossSettings, dapo_loss, dapo_loss_grad, stat_keys

NORM_LEN = 7
MODES = ["gspo", "cispo", "sapo", "dapo"]
CORRECTIONS = ["none", "token", "sequence", "sequence_geometric", "sequence_mask", "token_reject", "icepop"]


def random_case(seed: int, b: int = 4, t: int = 6) -> dict:
    rng = random.Random(seed)
    logp = [[rng.gauss(-1.0, 0.3) for _ in range(t)] for _ in range(b)]
    case = {
        "logp": logp,
        "old": [[x + rng.gauss(0.0, 0.25) for x in row] for row in logp],
        "adv": [[a] * t for a in (rng.gauss(0.0, 1.5) for _ in range(b))],  # one advantage a sequence
        "mask": [[1.0 if rng.random() > 0.25 else 0.0 for _ in range(t)] for _ in range(b)],
    }
    case["rollout"] = [[x + rng.gauss(0.0, 0.4) for x in row] for row in case["old"]]
    case["mask"][0][0] = 1.0
    return case


def settings(mode: str, agg: str, tis: str) -> LossSettings:
    # wide GSPO / CISPO bands and narrow mismatch bands: every branch (clipped or not, masked or not) is met
    return LossSettings(policy_loss=mode, agg_mode=agg, norm_len=NORM_LEN, tis=tis, tis_cap=1.5, dual_clip_c=None,
                        gspo_clip_low=0.05, gspo_clip_high=0.08, cispo_clip_low=0.2, cispo_clip_high=0.15,
                        sapo_tau_pos=1.0, sapo_tau_neg=1.05, seq_mask_low=0.8, seq_mask_high=1.25,
                        token_mask_low=0.7, token_mask_high=1.4, clip_low=0.2, clip_high=0.28)  # fmt: skip


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def token_term(s: LossSettings, logp: float, old: float, adv: float, seq_ratio: float) -> tuple[float, float]:
    """(l, dl/dlogp) of one token's policy term, from the papers' equations."""
    if s.policy_loss == "gspo":  # value s_i, gradient s_i through the token's own log-prob
        ratio, d_ratio = seq_ratio, seq_ratio
        low, high = 1 - s.gspo_clip_low, 1 + s.gspo_clip_high
    else:
        ratio = math.exp(logp - old)
        d_ratio = ratio
        low, high = 1 - s.clip_low, 1 + s.clip_high
    if s.policy_loss == "cispo":
        weight = min(max(ratio, max(0.0, 1 - s.cispo_clip_low)), 1 + s.cispo_clip_high)
        return -weight * adv * logp, -weight * adv
    if s.policy_loss == "sapo":
        tau = s.sapo_tau_pos if adv > 0 else s.sapo_tau_neg
        gate = sigmoid(tau * (ratio - 1))
        return -(4 / tau) * gate * adv, -4 * gate * (1 - gate) * ratio * adv
    unclipped, clipped = -adv * ratio, -adv * min(max(ratio, low), high)
    if unclipped >= clipped:  # max(): the unclipped term, with its gradient (ties: either, the same value)
        return unclipped, -adv * d_ratio
    return clipped, 0.0


def reference(case: dict, s: LossSettings) -> tuple[float, float, list[list[float]]]:
    """(numerator, denominator, d numerator / d logp) in Python floats."""
    b, t = len(case["logp"]), len(case["logp"][0])
    mask = [row[:] for row in case["mask"]]
    log_w = [[o - r for o, r in zip(orow, rrow)] for orow, rrow in zip(case["old"], case["rollout"])]
    weight = [[1.0] * t for _ in range(b)]
    for i in range(b):
        tokens = sum(mask[i])
        seq_log_w = sum(lw * m for lw, m in zip(log_w[i], mask[i]))
        for j in range(t):
            if s.tis == "token":
                weight[i][j] = min(math.exp(log_w[i][j]), s.tis_cap)
            elif s.tis == "sequence":  # the product of the sequence's weights, capped
                weight[i][j] = min(math.exp(seq_log_w), s.tis_cap)
            elif s.tis == "sequence_geometric":  # the geometric mean of the sequence's weights, capped
                weight[i][j] = min(math.exp(seq_log_w / max(tokens, 1)), s.tis_cap)
            elif s.tis in ("token_reject", "icepop"):
                k = math.exp(log_w[i][j])
                in_band = s.token_mask_low <= k <= s.token_mask_high
                if s.tis == "token_reject" and not in_band:  # out of the loss and of its denominator
                    mask[i][j] = 0.0
                if s.tis == "icepop":  # M(k): k inside the band, 0 outside; the denominator keeps the token
                    weight[i][j] = k if in_band else 0.0
        geo_mean = math.exp(seq_log_w / max(tokens, 1))
        if s.tis == "sequence_mask" and not s.seq_mask_low <= geo_mean <= s.seq_mask_high:
            mask[i] = [0.0] * t
    numerator, grad = 0.0, [[0.0] * t for _ in range(b)]
    seqs = sum(1 for row in mask if sum(row) > 0)
    for i in range(b):
        n_i = sum(mask[i])
        # GSPO's s_i over the sequence's loss tokens of the run's own mask (before any rollout correction)
        n_own = sum(case["mask"][i])
        seq_ratio = math.exp(sum((lp - o) * m for lp, o, m in zip(case["logp"][i], case["old"][i], case["mask"][i]))
                             / max(n_own, 1))  # fmt: skip
        for j in range(t):
            if not mask[i][j]:
                continue
            coeff = {"token-mean": 1.0, "seq-mean-token-mean": 1.0 / n_i, "seq-mean-token-sum": 1.0,
                     "seq-mean-token-sum-norm": 1.0 / NORM_LEN}[s.agg_mode]  # fmt: skip
            value, d_value = token_term(s, case["logp"][i][j], case["old"][i][j], case["adv"][i][j], seq_ratio)
            numerator += coeff * weight[i][j] * value
            grad[i][j] = coeff * weight[i][j] * d_value
    denominator = sum(map(sum, mask)) if s.agg_mode == "token-mean" else float(seqs)
    return numerator, denominator, grad


def tensors(case: dict) -> dict[str, torch.Tensor]:
    return {key: torch.tensor(value, dtype=torch.float64) for key, value in case.items()}


@pytest.mark.parametrize("tis", CORRECTIONS)
@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("mode", MODES)
def test_each_policy_loss_and_correction_equals_its_papers_formula_in_float64(mode, agg, tis):
    s = settings(mode, agg, tis)
    for seed in range(6):
        case = random_case(seed + 100 * LOSS_AGG_MODES.index(agg))
        x = tensors(case)
        logp, given = x["logp"].clone().requires_grad_(), {"rollout_logprobs_BT": x["rollout"]}
        numerator, denominator, stats = dapo_loss(logp, x["old"], x["adv"], x["mask"], s, **given)
        (grad,) = torch.autograd.grad(numerator, logp, allow_unused=True)
        want_num, want_den, want_grad = reference(case, s)
        assert numerator.item() == pytest.approx(want_num, rel=1e-12, abs=1e-12)
        assert denominator.item() == want_den
        grad = grad if grad is not None else torch.zeros_like(logp)
        torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=torch.float64), rtol=1e-12, atol=1e-13)
        # the gradient the fused head takes (per token; gspo: autograd through the loss) is the same
        d_logp, _ = dapo_loss_grad(x["logp"], x["old"], x["adv"], x["mask"], s, **given)
        torch.testing.assert_close(d_logp, grad, rtol=1e-12, atol=1e-13)
        assert set(stats) == set(stat_keys(s))


def test_the_cases_meet_every_branch():
    """A reference that never clipped or masked could not fail where the code clips or masks wrongly."""
    cases = [random_case(seed + 100 * k) for seed in range(6) for k in range(len(LOSS_AGG_MODES))]
    ratios = [math.exp(lp - o) for c in cases for lr, orow in zip(c["logp"], c["old"]) for lp, o in zip(lr, orow)]
    assert min(ratios) < 0.8 and max(ratios) > 1.2  # beyond CISPO's and DAPO's bands on both sides
    weights = [math.exp(o - r) for c in cases for orow, rrow in zip(c["old"], c["rollout"]) for o, r in zip(orow, rrow)]
    assert min(weights) < 0.7 and max(weights) > 1.5  # beyond the token mask's band and the TIS cap
    masked_seqs = 0
    for c in cases:
        for i, row in enumerate(c["mask"]):
            log_ws = [o - r for o, r, m in zip(c["old"][i], c["rollout"][i], row) if m]
            masked_seqs += bool(log_ws) and not 0.8 <= math.exp(sum(log_ws) / len(log_ws)) <= 1.25
    assert masked_seqs > 0
    geo = [math.exp(sum(o - r for o, r, m in zip(c["old"][i], c["rollout"][i], row) if m) / max(sum(row), 1))
           for c in cases for i, row in enumerate(c["mask"])]  # fmt: skip
    assert max(geo) > 1.5  # sequence_geometric's cap reached on some sequence
    s = settings("gspo", "token-mean", "none")
    clipped = [reference(c, s)[2][0] for c in cases]
    assert any(all(g == 0.0 for g in row) for row in clipped)  # GSPO's sequence clip active on some sequence


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
def test_gspo_is_the_papers_sequence_level_objective_under_sequence_mean(agg):
    """With one advantage a sequence, the token form under seq-mean-token-mean is GSPO's sequence objective
    1/G sum_i max(-A_i s_i, -A_i clip(s_i)) with s_i a function of all the sequence's log-probs (autograd of it
    here, in float64), and under token-mean each sequence weighs its length."""
    s = settings("gspo", agg, "none")
    for seed in range(10):
        x = tensors(random_case(seed))
        logp = x["logp"].clone().requires_grad_()
        numerator, denominator, _ = dapo_loss(logp, x["old"], x["adv"], x["mask"], s)
        (grad,) = torch.autograd.grad(numerator / denominator, logp)
        logp2 = x["logp"].clone().requires_grad_()
        tokens = x["mask"].sum(-1)
        s_i = (((logp2 - x["old"]) * x["mask"]).sum(-1) / tokens).exp()
        adv = x["adv"][:, 0]
        per_seq = torch.maximum(-adv * s_i, -adv * s_i.clamp(1 - s.gspo_clip_low, 1 + s.gspo_clip_high))
        weights = torch.ones_like(tokens) if agg == "seq-mean-token-mean" else tokens
        objective = (per_seq * weights).sum() / weights.sum()
        (want,) = torch.autograd.grad(objective, logp2)
        torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-13)


def test_only_gspo_needs_whole_sequences():
    assert [m for m in MODES if LossSettings(policy_loss=m).needs_whole_sequences] == ["gspo"]
    with pytest.raises(ValueError, match="policy_loss='gspox'"):
        LossSettings(policy_loss="gspox")
