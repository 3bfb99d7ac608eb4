"""avg@k, pass@k and maj@k on a fixed set of answers, computed by hand."""

import itertools

import pytest

from dapo_mcore.algo.eval_metrics import avg_at_k, maj_at_k, pass_at_k

# 3 problems x 4 answers
ANSWERS = [["5", "5", "7", None], ["1", "2", "2", "1"], ["9", "8", "8", "8"]]
CORRECT = [[True, True, False, False], [True, False, False, True], [True, False, False, False]]


def test_avg_at_k_by_hand():
    assert avg_at_k(CORRECT) == pytest.approx((2 / 4 + 2 / 4 + 1 / 4) / 3)


def test_pass_at_k_by_hand_and_by_enumeration():
    # problem 1: 1 - C(2,2)/C(4,2) = 5/6; problem 2: the same; problem 3: 1 - C(3,2)/C(4,2) = 1/2
    assert pass_at_k(CORRECT, 2) == pytest.approx((5 / 6 + 5 / 6 + 1 / 2) / 3)
    assert pass_at_k(CORRECT, 1) == pytest.approx(avg_at_k(CORRECT))
    assert pass_at_k(CORRECT, 4) == pytest.approx(1.0)
    # the estimator is the probability that a random k-subset holds a right answer
    for k in (1, 2, 3):
        brute = [
            sum(any(row[i] for i in subset) for subset in itertools.combinations(range(4), k))
            / len(list(itertools.combinations(range(4), k)))
            for row in CORRECT
        ]
        assert pass_at_k(CORRECT, k) == pytest.approx(sum(brute) / 3)


def test_maj_at_k_by_hand():
    # problem 1: "5" wins (right); problem 2: "1" and "2" tie, "1" seen first (right); problem 3: "8" (wrong)
    assert maj_at_k(ANSWERS, CORRECT, 4) == pytest.approx(2 / 3)
    # first 2 answers only: "5" (right), "1"/"2" tie -> "1" (right), "9"/"8" tie -> "9" (right)
    assert maj_at_k(ANSWERS, CORRECT, 2) == pytest.approx(1.0)


def test_no_answer_is_never_the_majority_and_bad_k_is_refused():
    assert maj_at_k([[None, None]], [[False, False]], 2) == 0.0
    with pytest.raises(ValueError, match="pass@5 needs at least 5 answers"):
        pass_at_k(CORRECT, 5)
    with pytest.raises(ValueError, match="at least one answer"):
        avg_at_k([[]])
