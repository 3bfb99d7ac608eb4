"""What a verifier is called with, and what it may return.

Three signatures are accepted, told apart by the function's parameters (call_style):
  - `fn(response, reference)`: the answer and the row's reference answer;
  - `fn(response, reference, row)` (a third parameter without a default, or one named `row`): also the data row,
    a dict of its `data_source` and every other field of the data file (data/types.py Prompt.row);
  - verl's `compute_score(data_source, solution_str, ground_truth, extra_info)` (a parameter named
    `solution_str`), called with those keywords that it takes; `extra_info` is the row's own `extra_info` object
    when it has one (verl's data files), else the row's other fields.

A verifier returns (read_value):
  - a bool: the verdict; the reward is algorithm.reward.correct or .wrong;
  - a number: correct from algorithm.reward.correct_threshold (0.5). Without algorithm.reward.graded it must lie
    in [0, 1] and the reward is .correct / .wrong, as for a bool; with it, the number is the reward itself
    (before the length shaping), any finite value;
  - a dict with a "score" (read as the number above) and named parts, each number or bool of it logged as
    reward_part/<name>; an "acc" entry (verl's), when present, is the verdict instead of the score's threshold,
    and the score is then used only as a graded reward. Other values (verl's "pred" string) are ignored.
Anything else (None, a string, NaN) is a ValueError naming it: a bug that would decide every reward silently.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

VERL_PARAMETERS = ("data_source", "solution_str", "ground_truth", "extra_info")


@dataclass(frozen=True)
class ScoreRule:
    """How a verifier's value is read: graded (a number is the reward) or a verdict, and the correct threshold."""

    graded: bool = False
    correct_threshold: float = 0.5

    def contract(self) -> str:
        number = "any finite number (the reward)" if self.graded else "a number in [0, 1]"
        return (
            f"a verifier returns a bool, {number} (correct from {self.correct_threshold:g}), or a dict with a "
            "'score' as those"
        )


# The default rule: values are verdicts, numbers in [0, 1] correct from 0.5.
VERDICTS = ScoreRule()


@dataclass
class Value:
    """A verifier's value, read: the verdict, the graded score (None: a bool verdict, or not graded) and the
    named parts of a dict."""

    correct: bool
    score: float | None = None
    parts: dict[str, float] = field(default_factory=dict)


def call_style(fn: Callable[..., Any]) -> str:
    """'verl', 'row' or 'pair' (module doc), from the function's parameters."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: the two-argument form
        return "pair"
    if "solution_str" in params:
        return "verl"
    # a third positional parameter without a default (fn(response, reference, strict=False) is the pair form)
    required = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                and p.default is p.empty]  # fmt: skip
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params.values())
    return "row" if "row" in params or len(required) >= 3 or (varargs and len(required) < 2) else "pair"


def call(fn: Callable[..., Any], style: str, response: str, reference: str, row: dict | None) -> object:
    row = row or {"data_source": ""}
    if style == "pair":
        return fn(response, reference)
    if style == "row":
        return fn(response, reference, row)
    return fn(**_verl_arguments(fn, response, reference, row))


def _verl_arguments(fn: Callable[..., Any], response: str, reference: str, row: dict) -> dict[str, Any]:
    others = {k: v for k, v in row.items() if k != "data_source"}
    extra_info = others["extra_info"] if isinstance(others.get("extra_info"), dict) else others
    offered = {"data_source": row.get("data_source", ""), "solution_str": response, "ground_truth": reference,
               "extra_info": extra_info}  # fmt: skip
    params = inspect.signature(fn).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return offered
    return {k: v for k, v in offered.items() if k in params}


def read_value(value: object, rule: ScoreRule) -> Value:
    """The verdict, graded score and parts of a verifier's return value (module doc); a ValueError naming what
    was returned when it is none of those."""
    if isinstance(value, dict):
        return _read_dict(value, rule)
    if is_bool(value):
        return Value(bool(value))
    score = _number(value, rule, "returned")
    return Value(score >= rule.correct_threshold, score if rule.graded else None)


def _read_dict(value: dict, rule: ScoreRule) -> Value:
    if "score" not in value:
        raise ValueError(f"returned a dict without a 'score' (keys {sorted(map(str, value))}): {rule.contract()}")
    parts = {str(k): _part(k, v) for k, v in value.items() if k != "score" and _is_number_or_bool(v)}
    acc = value.get("acc")
    if acc is not None and _is_number_or_bool(acc):  # verl's verdict beside its score
        score = _number(value["score"], ScoreRule(True, rule.correct_threshold), "returned 'score'")
        correct = bool(acc) if is_bool(acc) else float(acc) >= rule.correct_threshold
        return Value(correct, score if rule.graded else None, parts)
    if isinstance(value["score"], dict):
        raise ValueError(f"returned a dict whose 'score' is a dict: {rule.contract()}")
    read = read_value(value["score"], rule)
    return Value(read.correct, read.score, parts)


def _number(value: object, rule: ScoreRule, what: str) -> float:
    if is_bool(value):
        return float(bool(value))
    in_range = rule.graded or (isinstance(value, numbers.Real) and 0 <= value <= 1)
    if isinstance(value, numbers.Real) and math.isfinite(value) and in_range:
        return float(value)
    hint = "; set algorithm.reward.graded=true to use it as the reward" if _finite(value) and not rule.graded else ""
    raise ValueError(f"{what} {value!r} ({type(value).__name__}): {rule.contract()}{hint}")


def _part(name: object, value: object) -> float:
    if not _finite(value) and not is_bool(value):
        raise ValueError(f"returned the part {name!r} = {value!r}: a part is a finite number or a bool")
    return float(value)  # type: ignore[arg-type]


def is_bool(value: object) -> bool:
    """A bool, numpy's too (np.bool_, named "bool" under numpy 2; not a numbers.Real)."""
    kind = type(value)
    return isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"))


def _is_number_or_bool(value: object) -> bool:
    return is_bool(value) or isinstance(value, numbers.Real)


def _finite(value: object) -> bool:
    return isinstance(value, numbers.Real) and not is_bool(value) and math.isfinite(value)
