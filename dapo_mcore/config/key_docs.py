"""Each config key's description, read from the comment lines written just above its field in schema.py.

The schema's comments are its documentation (one place to keep them true); `dapo-mcore keys` shows them
beside each key. A field with no comment directly above it has no description.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import typing

from dapo_mcore.config import schema


@functools.cache
def key_descriptions() -> dict[str, str]:
    """Dotted key -> its schema comment as one paragraph, e.g. 'trainer.steps' -> 'RL steps (rollout + ...'."""
    try:
        source = inspect.getsource(schema)
    except OSError:  # installed without its .py sources: keys still list, without descriptions
        return {}
    comments = _field_comments(source)
    return dict(_dotted_descriptions(schema.RunConfig, "", comments))


def _field_comments(source: str) -> dict[tuple[str, str], str]:
    """(class name, field name) -> the comment block right above that field (no blank line between)."""
    lines = source.splitlines()
    found = {}
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                text = _comment_above(lines, node.lineno - 1)
                if text:
                    found[(cls.name, node.target.id)] = text
    return found


def _comment_above(lines: list[str], index: int) -> str:
    """The '#' lines directly above lines[index] (0-based), joined into one paragraph."""
    block = []
    while index > 0 and lines[index - 1].strip().startswith("#"):
        index -= 1
        block.insert(0, lines[index].strip().lstrip("#").strip())
    return " ".join(part for part in block if part)


def _dotted_descriptions(cls: type, prefix: str, comments: dict[tuple[str, str], str]):
    types_ = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(types_[f.name]):
            yield from _dotted_descriptions(types_[f.name], f"{prefix}{f.name}.", comments)
        elif (cls.__name__, f.name) in comments:
            yield f"{prefix}{f.name}", comments[(cls.__name__, f.name)]
