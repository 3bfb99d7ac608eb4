"""Published math data sets, in the layouts they are distributed in, turned into the project's prompt rows.

Layouts (parquet or jsonl, one row per problem):
  dapo-math   DAPO-Math-17k: `prompt` = chat messages [{"role": "user", "content": ...}],
              answer under `reward_model.ground_truth`
  gsm8k       `question`, `answer` whose last line is `#### N`
  math        MATH / MATH-500: `problem`, and `answer` or else the last \\boxed{...} of `solution`
  aime        AIME 2024 / 2025: `problem`, `answer`

Each row becomes {"prompt", "answer", "source"} with `source` = "<file name>:<row number>". A row that does
not fit its layout is an error naming the file, the row and what is wrong: nothing is skipped silently.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dapo_mcore.utils.errors import DataError
from dapo_mcore.utils.latex import last_boxed

LAYOUTS = ("dapo-math", "gsm8k", "math", "aime")


@dataclass(frozen=True)
class PromptRow:
    prompt: str
    answer: str
    source: str
    # verl's fields, kept where the file has them: the verifier a row goes to (algorithm.reward.verifiers) and
    # what a verifier that takes the row reads (docs/data.md)
    carried: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        row = {"prompt": self.prompt, "answer": self.answer, "source": self.source, **self.carried}
        return json.dumps(row, ensure_ascii=False, default=str)  # a parquet cell may hold dates, arrays


class RowError(ValueError):
    """What is wrong with one row; the caller adds the file and row number."""


def read_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of a .parquet, .jsonl or .json (a list of objects) file, as dicts."""
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        yield from _parquet_rows(path)
    elif suffix == ".jsonl":
        yield from _jsonl_rows(path)
    elif suffix == ".json":
        try:
            rows = _load_json(path.read_text(encoding="utf-8"), path)
        except UnicodeDecodeError:
            raise DataError(f"{path}: not UTF-8 text") from None
        if not isinstance(rows, list):
            raise DataError(f"{path}: expected a JSON list of rows, got {type(rows).__name__}")
        yield from rows
    else:
        raise DataError(f"{path}: unknown file type '{suffix}' (expected .parquet, .jsonl or .json)")


def _parquet_rows(path: Path) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for a damaged file
        raise DataError(f"{path}: not a readable parquet file ({err})") from None
    yield from table.to_pylist()


def _jsonl_rows(path: Path) -> Iterator[dict[str, Any]]:
    for line_no, raw in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(f"{path}:{line_no}: not UTF-8 text (byte {err.start})") from None
        if line.strip():
            yield _load_json(line, f"{path}:{line_no}")


def _load_json(text: str, where: object) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not valid JSON ({err.msg})") from None


def detect_layout(row: dict[str, Any], path: Path) -> str:
    """The layout a file's first row has, from its columns."""
    keys = set(row)
    if "prompt" in keys and "reward_model" in keys:
        return "dapo-math"
    if {"question", "answer"} <= keys:
        return "gsm8k"
    if "problem" in keys and "solution" in keys:
        return "math"
    if {"problem", "answer"} <= keys:
        return "aime"
    raise DataError(f"{path}: cannot tell the layout from the columns {sorted(keys)}; give --layout ({LAYOUTS})")


# Columns a converted row keeps as they are (verl's: DAPO-Math-17k has both).
CARRIED_FIELDS = ("data_source", "extra_info")


def convert_file(path: Path, layout: str | None = None) -> list[PromptRow]:
    """Every row of the file as a PromptRow; the first bad row is an error naming file and row."""
    out: list[PromptRow] = []
    convert: Callable[[dict[str, Any]], tuple[str, str]] | None = None
    for index, row in enumerate(read_rows(path), start=1):
        where = f"{path}: row {index}"
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected an object, got {type(row).__name__}")
        if convert is None:
            convert = _CONVERTERS[layout or detect_layout(row, path)]
        try:
            prompt, answer = convert(row)
        except RowError as err:
            raise DataError(f"{where}: {err}") from None
        carried = {key: row[key] for key in CARRIED_FIELDS if row.get(key) is not None}
        out.append(PromptRow(prompt=prompt, answer=answer, source=f"{path.name}:{index}", carried=carried))
    if not out:
        raise DataError(f"{path} holds no rows")
    return out


def _text(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    if value is None:
        raise RowError(f"missing '{key}' (columns: {sorted(row)})")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise RowError(f"'{key}' must be a non-empty string, got {value!r:.80}")
    return value.strip()


def _dapo_math(row: dict[str, Any]) -> tuple[str, str]:
    messages = row.get("prompt")
    if not isinstance(messages, list) or not messages:
        raise RowError("'prompt' must be a non-empty list of chat messages")
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if not users:
        raise RowError("'prompt' has no message with role 'user'")
    reward = row.get("reward_model")
    if not isinstance(reward, dict):
        raise RowError("'reward_model' must be an object holding 'ground_truth'")
    return _text(users[-1], "content"), _text(reward, "ground_truth")


_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$")


def _gsm8k(row: dict[str, Any]) -> tuple[str, str]:
    found = _GSM8K_FINAL.search(_text(row, "answer"))
    if not found:
        raise RowError("'answer' does not end with '#### N'")
    return _text(row, "question"), found.group(1).replace(",", "")


def _math(row: dict[str, Any]) -> tuple[str, str]:
    problem = _text(row, "problem")
    if row.get("answer") not in (None, ""):
        return problem, _text(row, "answer")
    boxed = last_boxed(_text(row, "solution"))
    if boxed is None:
        raise RowError("no 'answer' and no \\boxed{...} in 'solution'")
    return problem, boxed


def _aime(row: dict[str, Any]) -> tuple[str, str]:
    return _text(row, "problem"), _text(row, "answer")


_CONVERTERS = {"dapo-math": _dapo_math, "gsm8k": _gsm8k, "math": _math, "aime": _aime}


def deduplicate(rows: list[PromptRow]) -> tuple[list[PromptRow], list[tuple[PromptRow, PromptRow]]]:
    """Rows with a prompt seen before (ignoring white space) are left out; returns (kept, [(dropped, first)])."""
    first: dict[str, PromptRow] = {}
    kept, dropped = [], []
    for row in rows:
        key = " ".join(row.prompt.split())
        if key in first:
            dropped.append((row, first[key]))
        else:
            first[key] = row
            kept.append(row)
    return kept, dropped
