"""Statistics of the train/inference log-prob gap d = log p_actor - log p_engine over any number of tokens, in a
summary of fixed size: sums and a histogram that add across micro-batches and ranks (an all-reduce), and
extremes that take the maximum. Nothing here grows with the step's token count, which at the paper's shape
is 8M-168M response tokens (torch.quantile refuses more than 2^24, and gathering them all to every rank
would cost O(tokens) of host memory on each).

Quantiles come from the histogram: bins uniform in asinh(d / GAP_SCALE), so about 1% of relative resolution
from 1e-5 to 1e4 nats, and finer than GAP_SCALE near 0; values beyond the range land in the end bins (the
exact extremes are kept beside). A quantile follows torch.quantile's rule between order statistics, each
placed inside its bin by its rank there, so that a few tokens (a carried group) come out as close as many.

Legend: N tokens, S summary entries, B bins.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

GAP_BINS = 4096
GAP_SCALE = 1e-6
_U_MAX = math.asinh(1e4 / GAP_SCALE)  # |d| up to 1e4 nats gets its own bin
# summary layout: [tokens, sum |d|, sum k3, histogram (B)]
_TOKENS, _ABS, _K3, _HIST = 0, 1, 2, 3
SUMMARY_SIZE = _HIST + GAP_BINS
# extremes layout, each reduced by max: [max |d|, max d, -min d]
EXTREMES_SIZE = 3


def empty_gap_summary(device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(sums_S, extremes_3) of no tokens: zeros, and -inf for the extremes (the identity of max)."""
    sums_S = torch.zeros(SUMMARY_SIZE, dtype=torch.float64, device=device)
    return sums_S, torch.full((EXTREMES_SIZE,), -math.inf, dtype=torch.float64, device=device)


def add_gaps(sums_S: torch.Tensor, extremes_3: torch.Tensor, diff_N: torch.Tensor) -> None:
    """Add the tokens' gaps to a summary, in place (on the summary's device)."""
    if diff_N.numel() == 0:
        return
    d = diff_N.to(sums_S.device, torch.float64).reshape(-1)
    abs_d = d.abs()
    # k3 (Schulman): r - 1 - log r with r = p_actor / p_engine = exp(d); unbiased for KL(engine || actor), >= 0
    sums_S[_TOKENS] += d.numel()
    sums_S[_ABS] += abs_d.sum()
    sums_S[_K3] += (torch.expm1(d) - d).sum()
    sums_S[_HIST:] += torch.bincount(_bin_of(d), minlength=GAP_BINS).to(torch.float64)
    here = torch.stack([abs_d.max(), d.max(), -d.min()])
    torch.maximum(extremes_3, here, out=extremes_3)


def _bin_of(d: torch.Tensor) -> torch.Tensor:
    """Each gap's histogram bin. A NaN gap (a NaN log-prob, the actor's or the engine's) goes to the top bin: its
    sums are NaN then, which the mismatch guard stops on (as a bin index it made bincount raise instead)."""
    u = torch.asinh(torch.nan_to_num(d, nan=math.inf) / GAP_SCALE)
    return ((u + _U_MAX) * (GAP_BINS / (2 * _U_MAX))).floor().clamp_(0, GAP_BINS - 1).long()


def gap_tokens(sums_S: torch.Tensor) -> float:
    return float(sums_S[_TOKENS])


def gap_means(sums_S: torch.Tensor) -> tuple[float, float]:
    """(mean |d|, mean k3) of a reduced summary with tokens in it."""
    n = sums_S[_TOKENS]
    return float(sums_S[_ABS] / n), float(sums_S[_K3] / n)


def gap_quantiles(
    sums_S: torch.Tensor, extremes_3: torch.Tensor, qs: tuple[float, ...], of: Callable[[float], float] = float
) -> list[float]:
    """Quantiles of of(d) (an increasing function: math.exp gives the ratio's) from a reduced summary with
    tokens in it, by torch.quantile's rule (linear between the order statistics at q (n - 1), in of's units);
    each order statistic is placed inside its histogram bin by its rank there, within the exact extremes."""
    hist_B = sums_S[_HIST:].cpu()
    cumulative_B = hist_B.cumsum(0)
    n = float(cumulative_B[-1])
    low, high = -float(extremes_3[2]), float(extremes_3[1])
    out = []
    for q in qs:
        position = q * (n - 1)
        below = math.floor(position)
        ks = (below, min(below + 1, n - 1))
        lower, upper = (of(min(max(_order_statistic(hist_B, cumulative_B, k), low), high)) for k in ks)
        out.append(lower + (position - below) * (upper - lower))
    return out


def _order_statistic(hist_B: torch.Tensor, cumulative_B: torch.Tensor, k: float) -> float:
    """The k-th smallest d (0-based), placed in its bin at the middle of its share of the bin."""
    b = int(torch.searchsorted(cumulative_B, torch.tensor(k, dtype=cumulative_B.dtype), right=True))
    b = min(b, GAP_BINS - 1)
    before = float(cumulative_B[b - 1]) if b > 0 else 0.0
    inside = (k - before + 0.5) / max(float(hist_B[b]), 1.0)
    u = -_U_MAX + (b + min(max(inside, 0.0), 1.0)) * (2 * _U_MAX / GAP_BINS)
    return math.sinh(u) * GAP_SCALE
