"""DAPO's rule-based verifier: the final answer follows the last "Answer:" of the response.

The extracted answer and the reference are normalised the way the paper's evaluation does (the
Minerva-style normalisation of the authors' verl code): keep what follows the last '=', drop units,
LaTeX text wrappers and dollar signs, strip thousands separators from plain integers. Only the response's
last 300 characters are read, so a degenerate long output costs no more than a short one.
"""

from __future__ import annotations

import re

_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_TAIL_CHARS = 300
_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    (r"\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_REMOVED = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    r"\mathrm{th}",
    r"^\circ",
    r"^{\circ}",
    r"\;",
    r",\!",
    "{,}",
    '"',
    "\\dots",
)


def extract_answer(response: str) -> str | None:
    """The text after the last 'Answer:' in the response's tail, or None when there is none."""
    found = _ANSWER_RE.findall(response[-_TAIL_CHARS:])
    return found[-1] if found else None


def normalize_answer(answer: str) -> str:
    text = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        text = text.replace(before, after)
    for expr in _REMOVED:
        text = text.replace(expr, "")
    text = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$", text)
    text = re.sub(r"(\\text\{)(.*?)(\})", r"\2", text)
    text = re.sub(r"(\\textbf\{)(.*?)(\})", r"\2", text)
    text = re.sub(r"(\\overline\{)(.*?)(\})", r"\2", text)
    text = re.sub(r"(\\boxed\{)(.*)(\})", r"\2", text)
    text = text.replace("$", "").rstrip(".")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def is_correct(response: str, reference: str) -> bool:
    extracted = extract_answer(response)
    return extracted is not None and normalize_answer(extracted) == normalize_answer(reference)
