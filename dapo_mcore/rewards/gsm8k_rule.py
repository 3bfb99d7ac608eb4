"""GSM8K's rule: the response's final number equals the reference number.

The final number is the one after the last "####" (GSM8K's own answer marker), else after the last
"Answer:", else the last number in the response's tail. Thousands separators, a currency sign and a
trailing full stop are ignored and numbers compare by value ("3.50" equals "3.5", "-2" is negative).
Nothing from the response is evaluated.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_TAIL_CHARS = 300
_NUMBER = re.compile(r"-?\$?\s*\d[\d,]*(?:\.\d+)?|-?\$?\s*\.\d+")
_MARKERS = ("####", "Answer:")


def final_number(response: str) -> Decimal | None:
    tail = response[-_TAIL_CHARS:]
    for marker in _MARKERS:
        at = tail.rfind(marker)
        if at >= 0:
            found = _NUMBER.findall(tail[at + len(marker) :])
            if found:
                return _value(found[0])
    found = _NUMBER.findall(tail)
    return _value(found[-1]) if found else None


def _value(text: str) -> Decimal | None:
    cleaned = text.replace("$", "").replace(",", "").replace(" ", "").rstrip(".")
    try:
        return Decimal(cleaned)
    except InvalidOperation:
        return None


def is_correct(response: str, reference: str) -> bool:
    predicted, wanted = final_number(response), _value(reference.strip())
    return predicted is not None and wanted is not None and predicted == wanted
