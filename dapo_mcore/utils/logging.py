"""Rank-aware logging: rank 0 speaks at INFO, the other ranks only warn (their lines carry the rank)."""

from __future__ import annotations

import logging
import sys

_ROOT = "dapo_mcore"


def setup_logging(rank: int = 0, level: str = "INFO") -> None:
    root = logging.getLogger(_ROOT)
    root.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    tag = "" if rank == 0 else f"[rank {rank}] "
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {tag}%(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level if rank == 0 else "WARNING")
    root.propagate = False


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")
