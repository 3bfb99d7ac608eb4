"""The final answer of a response as each verifier reads it, normalised, for majority voting (maj@k).

Two responses vote for the same answer when these strings are equal. A custom verifier ('module:function')
votes with the DAPO rule's extraction.
"""

from __future__ import annotations

from collections.abc import Callable

from dapo_mcore.rewards import dapo_rule, gsm8k_rule, synthetic_rule
from dapo_mcore.utils.latex import last_boxed


def _dapo(text: str) -> str | None:
    found = dapo_rule.extract_answer(text)
    return None if found is None else dapo_rule.normalize_answer(found)


def _boxed_or_dapo(text: str) -> str | None:
    boxed = last_boxed(text[-1000:])
    return dapo_rule.normalize_answer(boxed) if boxed is not None else _dapo(text)


def _gsm8k(text: str) -> str | None:
    value = gsm8k_rule.final_number(text)
    return None if value is None else format(value.normalize(), "f")


_EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "dapo": _dapo,
    "math_verify": _boxed_or_dapo,
    "gsm8k": _gsm8k,
    "synthetic": synthetic_rule.verdict,  # votes "correct" or "wrong": maj@k is right when most answers are
}


def answer_extractor(verifier: str) -> Callable[[str], str | None]:
    return _EXTRACTORS.get(verifier, _dapo)


# The rules held-out answers may also be checked by (trainer.eval_also_verifiers, `eval --also-verifier`): pure
# functions of the answer's last characters, run in the calling process (no worker, no timeout needed).
_ALSO_CHECKS: dict[str, Callable[[str, str], bool]] = {"dapo": dapo_rule.is_correct, "gsm8k": gsm8k_rule.is_correct}
ALSO_RULES = tuple(_ALSO_CHECKS)


def also_rule(name: str) -> tuple[Callable[[str, str], bool], Callable[[str], str | None]]:
    """(is_correct, extract) of one of ALSO_RULES."""
    if name not in _ALSO_CHECKS:
        raise ValueError(f"{name!r} is not one of {ALSO_RULES}")
    return _ALSO_CHECKS[name], answer_extractor(name)
