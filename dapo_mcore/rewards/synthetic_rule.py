"""The synthetic engine's reward rule (rollout.engine=synthetic: scale rehearsals and tests only).

That engine has no model and its answers no meaning: it decides each answer's verdict itself, when it draws the
answer (each prompt's solve probability from a Beta around rollout.synthetic.solve_rate, each answer correct
with it by a hash of the seed, the prompt and the answer: rollout/synthetic_engine.py), and ends the answer's
text with that verdict. This rule reads it back, so that the verdicts take the real reward path: the verifier
pool, rewards and length shaping, the dynamic-sampling filter. Nothing of a response is executed or parsed
beyond that fixed ending: text of any other engine is wrong.
"""

from __future__ import annotations

VERDICT_MARK = "synthetic verdict: "
_CORRECT, _WRONG = "correct", "wrong"


def verdict_text(correct: bool) -> str:
    """How a synthetic answer's text ends."""
    return VERDICT_MARK + (_CORRECT if correct else _WRONG)


def verdict(response: str) -> str | None:
    """The verdict, "correct" or "wrong", that the response ends with; None when it has none (not a synthetic
    answer)."""
    for word in (_CORRECT, _WRONG):
        if response.endswith(VERDICT_MARK + word):
            return word
    return None


def is_correct(response: str, reference: str) -> bool:
    """The verdict the synthetic engine drew (the reference answer plays no part)."""
    return verdict(response) == _CORRECT
