#!/usr/bin/env python
"""Published math data sets (local parquet / jsonl files) -> the project's prompt files (.jsonl).

    python tools/prepare_data.py FILE [FILE ...] --out train.jsonl [--layout dapo-math|gsm8k|math|aime]
                                 [--heldout N --heldout-out heldout.jsonl] [--seed 0] [--keep-duplicates]
                                 [--instruction dapo]

Each output row is {"prompt", "answer", "source"} ("source" = input file name and row number), with verl's
"data_source" and "extra_info" where the input has them (a row's verifier: algorithm.reward.verifiers), the
format `data.source` and `dapo-mcore eval` read. The layout of each file is recognised from its columns unless
--layout is given (see dapo_mcore/data/published.py). A bad row stops with one line naming the file and the
row; prompts seen before are reported (with both places) and left out unless --keep-duplicates; --heldout
moves N rows, drawn with --seed, into a second file for validation. Nothing is dropped without a line saying so.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import replace
from pathlib import Path

from dapo_mcore.data.published import LAYOUTS, PromptRow, convert_file, deduplicate
from dapo_mcore.data.templates import instruction_parts, wrap
from dapo_mcore.utils.errors import DapoError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--layout", choices=LAYOUTS)
    ap.add_argument("--heldout", type=int, default=0, help="rows moved to --heldout-out")
    ap.add_argument("--heldout-out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-duplicates", action="store_true")
    ap.add_argument(
        "--instruction",
        default="none",
        help="wrap each prompt: 'dapo' (the paper's instruction, as DAPO-Math-17k's prompts carry it) or a text "
        "with {problem} in it; training and evaluation files then read alike with data.instruction=none",
    )
    args = ap.parse_args(argv)
    if args.heldout and not args.heldout_out:
        ap.error("--heldout needs --heldout-out")
    try:
        rows = with_instruction(convert(args.files, args.layout, args.keep_duplicates), args.instruction)
        train, heldout = split(rows, args.heldout, args.seed)
    except DapoError as err:
        print(f"prepare_data: error: {err}", file=sys.stderr)
        return 2
    write(args.out, train)
    if heldout:
        write(args.heldout_out, heldout)
    return 0


def convert(files: list[Path], layout: str | None, keep_duplicates: bool) -> list[PromptRow]:
    rows: list[PromptRow] = []
    for path in files:
        converted = convert_file(path, layout)
        print(f"{path}: {len(converted)} rows")
        rows += converted
    if keep_duplicates:
        return rows
    kept, dropped = deduplicate(rows)
    if dropped:
        print(f"{len(dropped)} duplicate prompts left out (--keep-duplicates keeps them), e.g.:")
        for row, first in dropped[:5]:
            print(f"  {row.source} repeats {first.source}")
    return kept


def with_instruction(rows: list[PromptRow], instruction: str) -> list[PromptRow]:
    prefix, suffix = instruction_parts(instruction)
    return [replace(row, prompt=wrap(row.prompt, prefix, suffix)) for row in rows]


def split(rows: list[PromptRow], n_heldout: int, seed: int) -> tuple[list[PromptRow], list[PromptRow]]:
    if n_heldout >= len(rows):
        raise DapoError(f"--heldout {n_heldout} leaves no training rows (there are {len(rows)})")
    picked = set(random.Random(seed).sample(range(len(rows)), n_heldout))
    return [r for i, r in enumerate(rows) if i not in picked], [r for i, r in enumerate(rows) if i in picked]


def write(path: Path, rows: list[PromptRow]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(row.to_json() + "\n" for row in rows), encoding="utf-8")
    tmp.replace(path)  # a reader never sees half a file
    print(f"wrote {len(rows)} rows to {path}")


if __name__ == "__main__":
    sys.exit(main())
