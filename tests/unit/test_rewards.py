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
        ("$\\boxed{\\dfrac12}$", "\\frac{1}{2}", True),  # equivalent LaTeX forms
        ("$\\boxed{-3}$", "-3", True),  # negative numbers
        ("$\\boxed{3}$", "-3", False),
        ("$\\boxed{2, 1}$", "1, 2", True),  # several answers, any order
        ("$\\boxed{12\\text{ cm}}$", "12", True),  # units
        ("$\\boxed{x=5}$", "5", True),
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


@pytest.mark.parametrize(
    "response, reference, expected",
    [
        ("She pays 3 + 15 = 18 dollars.\n#### 18", "18", True),
        ("So the total is $1,203.", "1203", True),  # currency sign, thousands separator, full stop
        ("The change is -2 degrees.", "-2", True),  # negative numbers
        ("The change is 2 degrees.", "-2", False),
        ("It costs 3.50 in all. Answer: 3.5", "3.5", True),  # compared by value
        ("First 7 apples, then 12. #### 7", "12", False),  # the marked number counts, not the last one
        ("Answer: 42\nThat took 3 steps.", "42", True),  # after 'Answer:', not the trailing count
        ("no number at all", "4", False),
        ("#### 5", "five", False),  # a reference that is not a number matches nothing
    ],
)
def test_gsm8k_rule_compares_the_final_number(response, reference, expected):
    from dapo_mcore.rewards.gsm8k_rule import is_correct as gsm8k_correct

    assert gsm8k_correct(response, reference) is expected


def test_gsm8k_is_a_builtin_verifier():
    from dapo_mcore.rewards.pool import resolve_verifier

    assert resolve_verifier("gsm8k")("#### 1,000", "1000")
