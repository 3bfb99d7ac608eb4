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


@pytest.mark.parametrize(
    "response, reference, expected",
    [
        ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", True),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),
        ("$x = 3$", "4", False),
        ("Answer: 19", "19", True),  # no LaTeX: falls back to the "Answer:" rule
        ("no answer at all", "19", False),
    ],
)
def test_math_verify_compares_symbolically(response, reference, expected):
    from dapo_mcore.rewards.math_verify_rule import is_correct as math_is_correct

    assert math_is_correct(response, reference) is expected


def test_math_verify_never_hands_model_text_to_sympy_parse_expr(monkeypatch):
    import math_verify.parser

    from dapo_mcore.rewards.math_verify_rule import is_correct as math_is_correct

    def refuse(expr):
        raise AssertionError(f"parse_expr (Python eval) was reached with {expr!r}")

    monkeypatch.setattr(math_verify.parser, "parse_expr_cached", refuse)
    assert math_is_correct("The result is 9^9^9^9 + 1/2", "1") is False
    assert math_is_correct("so \\boxed{3}", "3") is True
