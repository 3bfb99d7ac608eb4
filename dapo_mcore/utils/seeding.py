"""Deterministic seeds derived from a base seed and a path of keys (step, round, rank, ...)."""

from __future__ import annotations

import hashlib


def derive_seed(base: int, *keys: object) -> int:
    """A stable 63-bit seed for (base, *keys): the same on every machine and Python run."""
    text = "/".join(str(k) for k in (base, *keys))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1
