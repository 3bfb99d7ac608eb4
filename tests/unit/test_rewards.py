import pytest

from dapo_mcore.rewards.dapo_rule import extract_answer, is_correct, normalize_answer


@pytest.mark.parametrize(
    "response, reference, expected",
    [
        ("hmm, Answer: 19", "19", True),
        ("Answer: 18", "19", False),
        ("no final answer", "19", False),
        ("Answer: 3\nlater... Answer: 19", "19", True),  # the last "Answer:" counts
        ("answer : 1,000 dollars", "1000", True),
        ("Answer: $\\boxed{42}$", "42", True),
        ("Answer: x = 5.", "5", True),
    ],
)
def test_dapo_rule(response, reference, expected):
    assert is_correct(response, reference) is expected


def test_only_the_tail_is_read():
    assert extract_answer("Answer: 7" + " " * 400) is None
    assert extract_answer("x" * 10_000 + "Answer: 7") == "7"


def test_normalisation_strips_latex_text_and_units():
    assert normalize_answer("\\text{12} inches") == "12"
