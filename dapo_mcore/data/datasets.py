"""Prompt sources (the arithmetic generator or a .jsonl file) and the epoch-shuffled stream over them.

The stream's position (epoch, offset) is its whole state, so a resumed run sees the same prompts next.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dapo_mcore.data.arithmetic import ArithmeticTask
from dapo_mcore.data.types import Prompt
from dapo_mcore.utils.errors import DataError


def load_jsonl_prompts(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Prompt]:
    """Every row must be a JSON object with a non-empty string prompt and an answer; errors name the line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    prompts = []
    with path.open("rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{path}:{line_no}: not UTF-8 text (byte {err.start}: {raw[err.start : err.start + 1]!r})"
                ) from None
            if line.strip():
                prompts.append(_parse_row(line, line_no, path, prompt_key, answer_key))
    if not prompts:
        raise DataError(f"{path} holds no prompts")
    return prompts


def _parse_row(line: str, line_no: int, path: Path, prompt_key: str, answer_key: str) -> Prompt:
    where = f"{path}:{line_no}"
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not valid JSON ({err.msg})") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for key in (prompt_key, answer_key):
        if key not in row:
            raise DataError(f"{where}: missing key '{key}' (keys present: {sorted(row)})")
    prompt, answer = row[prompt_key], row[answer_key]
    if not isinstance(prompt, str) or not prompt:
        raise DataError(f"{where}: '{prompt_key}' must be a non-empty string")
    if not isinstance(answer, (str, int, float)):
        raise DataError(f"{where}: '{answer_key}' must be a string or a number, got {type(answer).__name__}")
    return Prompt(text=prompt, answer=str(answer), uid=f"{path.name}:{line_no}")


def build_prompt_source(
    source: str, prompt_key: str, answer_key: str, min_operand: int, max_operand: int, ops: str
) -> Sequence[Prompt]:
    if source == "arithmetic":
        return ArithmeticTask(min_operand, max_operand, ops)
    return load_jsonl_prompts(source, prompt_key, answer_key)


class PromptStream:
    """Endless prompts: each epoch is a fresh seeded permutation of the source."""

    def __init__(self, source: Sequence[Prompt], seed: int):
        self.source, self.seed = source, seed
        self.epoch, self.offset = 0, 0
        self._order = self._permutation(0)

    def take(self, count: int) -> list[Prompt]:
        out = []
        for _ in range(count):
            if self.offset == len(self._order):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            out.append(self.source[self._order[self.offset]])
            self.offset += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._order = self._permutation(self.epoch)

    def _permutation(self, epoch: int) -> Sequence[int]:
        seed = f"{self.seed}/{epoch}"
        if len(self.source) > SHUFFLED_LIST_MAX:
            return FeistelPermutation(len(self.source), seed)
        order = list(range(len(self.source)))
        random.Random(seed).shuffle(order)
        return order


# Sources up to this size are shuffled as a list (every data file and the demo's grid, whose orders stay as they
# were); larger ones (an arithmetic grid of 4-digit operands has 16M problems: its list took 16 s and 0.6 GB,
# one of 5-digit operands could not be built at all) get a permutation computed per index.
SHUFFLED_LIST_MAX = 1 << 20
_MASK64 = (1 << 64) - 1


class FeistelPermutation(Sequence[int]):
    """A seeded permutation of range(n) in O(1) memory: a 4-round Feistel network over the smallest power of
    two with an even bit count >= n is a bijection of that range; indices that land past n are mapped again
    (cycle walking: the range is at most 4n, so a few rounds on average) until they fall inside."""

    def __init__(self, n: int, seed: str):
        bits = max(2, (n - 1).bit_length())
        self.n, self.half = n, (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        rng = random.Random(seed)
        self.keys = [rng.getrandbits(64) for _ in range(4)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:  # type: ignore[override]
        if not 0 <= index < self.n:
            raise IndexError(index)
        value = self._encrypt(index)
        while value >= self.n:
            value = self._encrypt(value)
        return value

    def _encrypt(self, value: int) -> int:
        left, right = value >> self.half, value & self.mask
        for key in self.keys:
            mixed = ((right ^ key) * 0x9E3779B97F4A7C15) & _MASK64
            left, right = right, left ^ ((mixed ^ (mixed >> 29)) & self.mask)
        return (left << self.half) | right
