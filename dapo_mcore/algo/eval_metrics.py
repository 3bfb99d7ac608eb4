"""Evaluation metrics over k sampled answers per problem: avg@k, pass@k, maj@k (pure functions).

avg@k  mean over problems of the fraction of a problem's k answers that are correct (DAPO's AIME avg@32)
pass@k the unbiased estimator of Chen et al. (2021) from n >= k answers with c correct:
       1 - C(n - c, k) / C(n, k), averaged over problems
maj@k  the answer given most often among a problem's first k (ties: the one seen first) is correct
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from math import comb


def avg_at_k(correct: Sequence[Sequence[bool]]) -> float:
    """correct[i][j]: answer j of problem i is right."""
    _check(correct)
    return sum(sum(row) / len(row) for row in correct) / len(correct)


def pass_at_k(correct: Sequence[Sequence[bool]], k: int) -> float:
    _check(correct)
    total = 0.0
    for row in correct:
        n, c = len(row), sum(row)
        if k > n:
            raise ValueError(f"pass@{k} needs at least {k} answers per problem, a problem has {n}")
        total += 1.0 - comb(n - c, k) / comb(n, k)
    return total / len(correct)


def maj_at_k(answers: Sequence[Sequence[str | None]], correct: Sequence[Sequence[bool]], k: int) -> float:
    """answers[i][j]: problem i's answer j, normalised (None: no answer found, never the majority)."""
    _check(correct)
    hits = 0
    for given, right in zip(answers, correct, strict=True):
        votes = Counter(a for a in given[:k] if a is not None)
        if not votes:
            continue
        top = max(votes.values())
        winner = next(a for a in given[:k] if a is not None and votes[a] == top)  # ties: the first seen
        hits += right[given.index(winner)]
    return hits / len(correct)


def _check(correct: Sequence[Sequence[bool]]) -> None:
    if not correct or any(len(row) == 0 for row in correct):
        raise ValueError("every problem needs at least one answer")


def eval_metrics(
    correct: Sequence[Sequence[bool]], answers: Sequence[Sequence[str | None]], k: int
) -> dict[str, float]:
    """The problem count, avg@k, maj@k and pass@j for j = 1, 2, 4, ... up to k (and k itself)."""
    out = {"problems": float(len(correct)), f"avg@{k}": avg_at_k(correct), f"maj@{k}": maj_at_k(answers, correct, k)}
    for j in _pass_ks(k):
        out[f"pass@{j}"] = pass_at_k(correct, j)
    return out


def _pass_ks(k: int) -> list[int]:
    ks, j = [], 1
    while j < k:
        ks.append(j)
        j *= 2
    return [*ks, k]
