"""Prompt sources (the arithmetic generator or a .jsonl file) and the epoch-shuffled stream over them.

The stream's position (epoch, offset) is its whole state, so a resumed run sees the same prompts next; with a
data file, the save also holds the file's fingerprint, and a resume refuses a changed file (the same position
in another file is other prompts) unless told to continue.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dapo_mcore.data.arithmetic import ArithmeticTask
from dapo_mcore.data.types import Prompt
from dapo_mcore.utils.errors import DataError
from dapo_mcore.utils.logging import get_logger

log = get_logger(__name__)


# The row field naming the row's source (verl's name): the verifier of that source judges it.
DATA_SOURCE_KEY = "data_source"

# The longest reference answer a prompt file may hold: final answers are numbers and expressions.
MAX_ANSWER_CHARS = 10_000


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
    if len(str(answer)) > MAX_ANSWER_CHARS:  # every check against it timed out, and the warning named the answer
        raise DataError(
            f"{where}: the reference '{answer_key}' is {len(str(answer)):,} characters, over {MAX_ANSWER_CHARS:,}: "
            "a verifier compares final answers (a number, an expression), not documents; is it the right key?"
        )
    data_source = row.get(DATA_SOURCE_KEY) or ""
    if not isinstance(data_source, str):
        raise DataError(f"{where}: '{DATA_SOURCE_KEY}' must be a string (the verifier's name for it), got "
                        f"{data_source!r}")  # fmt: skip
    extra = {k: v for k, v in row.items() if k not in (prompt_key, answer_key, DATA_SOURCE_KEY)}
    return Prompt(prompt, str(answer), f"{path.name}:{line_no}", data_source, extra)


def build_prompt_source(
    source: str, prompt_key: str, answer_key: str, min_operand: int, max_operand: int, ops: str
) -> Sequence[Prompt]:
    if source == "arithmetic":
        return ArithmeticTask(min_operand, max_operand, ops)
    return load_jsonl_prompts(source, prompt_key, answer_key)


def source_fingerprint(path: str | Path, prompts: Sequence[Prompt]) -> dict[str, Any]:
    """What a resume compares: the data file's size, and the rows a run uses (after the length policy) with a
    hash of them in order (row numbers included: reordered rows differ). `sha256_rows` leaves the file's name
    out (a byte-identical copy under another name is the same data); `sha256`, with it, is what saves made
    before it hold, compared only with those."""
    named, rows = hashlib.sha256(), hashlib.sha256()
    for p in prompts:
        named.update(json.dumps([p.uid, p.text, p.answer]).encode())
        rows.update(json.dumps([p.uid.rsplit(":", 1)[-1], p.text, p.answer]).encode())
    return {"file": str(path), "bytes": Path(path).stat().st_size, "rows": len(prompts), "sha256": named.hexdigest(),
            "sha256_rows": rows.hexdigest()}  # fmt: skip


def fingerprint_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    changes = [f"{key} {saved[key]} -> {now[key]}" for key in ("bytes", "rows") if saved[key] != now[key]]
    digest = "sha256_rows" if "sha256_rows" in saved else "sha256"
    if saved[digest] != now[digest]:
        changes.append("the rows' content or order differs (sha256)")
    return changes


class PromptStream:
    """Endless prompts: each epoch is a fresh seeded permutation of the source. `fingerprint`: the data file's
    (source_fingerprint), checked against a save's at load_state_dict; None for a generated source."""

    def __init__(
        self,
        source: Sequence[Prompt],
        seed: int,
        fingerprint: dict[str, Any] | None = None,
        allow_changed: bool = False,
    ):
        self.source, self.seed = source, seed
        self.fingerprint, self.allow_changed = fingerprint, allow_changed
        self.epoch, self.offset = 0, 0
        self._order = self._permutation(0)

    def take(self, count: int) -> list[Prompt]:
        out = []
        for _ in range(count):
            if self.offset >= len(self._order):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            out.append(self.source[self._order[self.offset]])
            self.offset += 1
        return out

    @property
    def taken(self) -> int:
        """Prompts taken since the stream began, over every epoch (the same on every rank)."""
        return self.epoch * len(self.source) + self.offset

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self._check_source(state.get("fingerprint"))  # saves before fingerprints have none
        self._order = self._permutation(self.epoch)

    def _check_source(self, saved: dict[str, Any] | None) -> None:
        if saved is None or self.fingerprint is None:
            return
        changes = fingerprint_changes(saved, self.fingerprint)
        if not changes:
            return
        where = f"the save's position (epoch {self.epoch}, prompt {self.offset} of {saved['rows']})"
        if not self.allow_changed:
            raise DataError(
                f"data file {self.fingerprint['file']} changed since the save ({'; '.join(changes)}): {where} would "
                "point at other prompts; restore the file, or set data.allow_changed_data=true to continue with it"
            )
        log.warning(
            "data file %s changed since the save (%s); data.allow_changed_data=true: continuing at %s in the new "
            "file's order%s", self.fingerprint["file"], "; ".join(changes), where,
            " (past its end: the next epoch starts)" if self.offset >= len(self.source) else "",
        )  # fmt: skip

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
