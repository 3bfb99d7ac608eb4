"""Train/inference log-prob gap metrics from a fixed-size summary: any number of tokens, summed across ranks."""

import math

import pytest
import torch

from dapo_mcore.algo.gap_stats import (
    SUMMARY_SIZE,
    add_gaps,
    empty_gap_summary,
    gap_means,
    gap_quantiles,
    gap_tokens,
)
from dapo_mcore.mcore.actor import _gap_metrics


def exact_quantile(sorted_d: torch.Tensor, q: float) -> float:
    """torch.quantile's linear rule, on an already sorted tensor (torch.quantile itself refuses > 2^24)."""
    pos = q * (sorted_d.numel() - 1)
    lo, frac = int(pos), pos - int(pos)
    hi = min(lo + 1, sorted_d.numel() - 1)
    return float(sorted_d[lo] * (1 - frac) + sorted_d[hi] * frac)


def test_metrics_over_more_than_two_to_the_24_tokens():
    """The paper's step passes 2^24 response tokens at a 2,048-token mean: torch.quantile refused that many
    (the crash this replaces); the summary takes them in micro-batch pieces, in O(1) memory."""
    n = 2**24 + 1
    g = torch.Generator().manual_seed(0)
    diff = torch.randn(n, generator=g) * 0.02 + torch.randn(n, generator=g).pow(3) * 1e-3  # heavy tails
    sums, extremes = empty_gap_summary()
    for piece in diff.split(1 << 21):
        add_gaps(sums, extremes, piece)
    assert sums.numel() == SUMMARY_SIZE and gap_tokens(sums) == n
    d = diff.double()
    abs_mean, k3 = gap_means(sums)
    assert abs_mean == pytest.approx(float(d.abs().mean()), rel=1e-9)
    assert k3 == pytest.approx(float((torch.expm1(d) - d).mean()), rel=1e-9)
    assert float(extremes[0]) == float(d.abs().max()) and float(extremes[1]) == float(d.max())
    sorted_d = d.sort().values
    for q, got in zip((0.01, 0.5, 0.9, 0.99), gap_quantiles(sums, extremes, (0.01, 0.5, 0.9, 0.99))):
        want = exact_quantile(sorted_d, q)
        assert got == pytest.approx(want, rel=0.01, abs=1e-8), q
    metrics = _gap_metrics(sums, extremes, "mismatch")
    assert metrics["mismatch/ratio_max"] == pytest.approx(math.exp(float(d.max())), rel=1e-12)
    assert metrics["mismatch/ratio_p50"] == pytest.approx(math.exp(exact_quantile(sorted_d, 0.5)), rel=1e-4)


def test_summaries_of_parts_add_up_to_the_summary_of_the_whole():
    """What each rank and micro-batch adds, summed (the all-reduce), is the whole step's summary."""
    diff = torch.randn(10_000, dtype=torch.float64) * 0.1
    whole = empty_gap_summary()
    add_gaps(*whole, diff)
    parts = [empty_gap_summary() for _ in range(3)]
    for part, piece in zip(parts, diff.tensor_split(3)):
        add_gaps(*part, piece)
    sums = sum(p[0] for p in parts)
    extremes = torch.stack([p[1] for p in parts]).amax(0)
    torch.testing.assert_close(sums, whole[0], rtol=1e-12, atol=1e-9)
    assert torch.equal(extremes, whole[1])


@pytest.mark.parametrize("scale", [1e-7, 1e-3, 1.0, 30.0])
def test_quantiles_stay_within_one_percent_of_the_gap_at_every_scale(scale):
    """fp32 CPU engines differ from the actor by ~1e-7 nats, bf16 GPU engines by ~1e-2, a broken push by
    nats: the bins resolve each."""
    diff = torch.randn(50_001, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * scale
    summary = empty_gap_summary()
    add_gaps(*summary, diff)
    sorted_d = diff.sort().values
    for q, got in zip((0.1, 0.5, 0.9, 0.99), gap_quantiles(*summary, (0.1, 0.5, 0.9, 0.99))):
        assert got == pytest.approx(exact_quantile(sorted_d, q), rel=0.01, abs=1e-8), q


@pytest.mark.parametrize("n", [1, 2, 7, 50])
def test_a_few_tokens_give_torch_quantiles_rule(n):
    """A carried-over group may bring a few dozen tokens: the quantiles interpolate between order statistics as
    torch.quantile does, not inside one bin."""
    diff = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64) * 0.3
    summary = empty_gap_summary()
    add_gaps(*summary, diff)
    want = torch.quantile(diff, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    for got, exact in zip(gap_quantiles(*summary, (0.5, 0.9, 0.99)), want):  # each order statistic within 1%
        assert got == pytest.approx(exact, abs=0.01 * float(diff.abs().max()))
    ratios = torch.quantile(diff.exp(), torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist()
    for got, exact in zip(gap_quantiles(*summary, (0.5, 0.9, 0.99), of=math.exp), ratios):  # in the ratio's units
        assert got == pytest.approx(exact, rel=0.01 * float(diff.abs().max()))


def test_no_tokens_give_no_metrics():
    assert _gap_metrics(*empty_gap_summary(), "offpolicy") == {}


def test_a_nan_gap_makes_the_kl_nan_for_the_guard_instead_of_raising():
    """A NaN log-prob (the actor's or the engine's) made its histogram bin index garbage and bincount raise
    ("bincount only supports 1-d non-negative integral inputs") before the mismatch guard could name it."""
    sums_S, extremes_3 = empty_gap_summary()
    add_gaps(sums_S, extremes_3, torch.tensor([0.01, float("nan"), -0.02]))
    assert gap_tokens(sums_S) == 3
    metrics = _gap_metrics(sums_S, extremes_3, "mismatch")
    assert math.isnan(metrics["mismatch/k3_kl"])
