"""math-verify: symbolic equality of the response's final LaTeX answer (\\boxed{...}, $...$) and the reference.

Only math-verify's LaTeX extraction is used (an ANTLR grammar). Its plain-expression path hands strings of
digits and operators from the response to sympy's `parse_expr`, i.e. to Python's eval: the character set
rules out code injection, but not evaluating the model's arithmetic (an exponent tower like 9^9^9^9 can run
for hours), and model output is never evaluated here. Responses without a LaTeX answer fall back to DAPO's
"Answer:" rule. Checks run in the verifier pool's worker processes, under its timeout.
"""

from __future__ import annotations

import logging

from dapo_mcore.rewards import dapo_rule

# math-verify warns that its own (signal-based) timeouts are off: the verifier pool provides the timeout.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_TAIL_CHARS = 1000  # the final answer is at the end; parsing a whole degenerate output costs time


def is_correct(response: str, reference: str) -> bool:
    from math_verify import LatexExtractionConfig, parse, verify

    latex = [LatexExtractionConfig(boxed_match_priority=0)]
    predicted = parse(response[-_TAIL_CHARS:], extraction_config=latex, parsing_timeout=None)
    if not predicted:
        return dapo_rule.is_correct(response, reference)
    gold = parse(f"${reference}$", extraction_config=latex, parsing_timeout=None)
    return bool(gold) and bool(verify(gold, predicted, timeout_seconds=None))
