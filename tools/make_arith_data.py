#!/usr/bin/env python
"""Prompt files of arithmetic problems with a held-out split that shares no problem with training.

    python tools/make_arith_data.py OUT_DIR [--min 0 --max 19 --ops + --heldout 80 --seed 0]
                                    [--data-source NAME [--append]]

Writes OUT_DIR/train.jsonl and OUT_DIR/heldout.jsonl ({"prompt", "answer"} rows, the format `data.source`,
`data.eval_files` and `dapo-mcore eval` read): every problem of the operand grid (the project's arithmetic
generator, "What is a+b?"), shuffled with --seed, the first --heldout of them held out. The SmolLM2 recipe's
files in examples/data/sums-0-19/ were made with the defaults.

--data-source NAME gives every row `data_source` NAME and verl's `extra_info` ({"split", "index"}); with --append
the rows go after those already in the files: a file of several sources (docs/data.md). examples/data/mixed/:

    python tools/make_arith_data.py examples/data/mixed --heldout 40 --data-source sums
    python tools/make_arith_data.py examples/data/mixed --heldout 40 --ops - --data-source differences --append
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from dapo_mcore.data.arithmetic import ArithmeticTask


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--min", type=int, default=0, dest="min_operand")
    ap.add_argument("--max", type=int, default=19, dest="max_operand")
    ap.add_argument("--ops", default="+")
    ap.add_argument("--heldout", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data-source", help="the rows' data_source (and verl's extra_info)")
    ap.add_argument("--append", action="store_true", help="add the rows to the files there")
    args = ap.parse_args(argv)
    task = ArithmeticTask(args.min_operand, args.max_operand, args.ops)
    if not 0 < args.heldout < len(task):
        ap.error(f"--heldout must be between 1 and {len(task) - 1} (the grid holds {len(task)} problems)")
    order = list(range(len(task)))
    random.Random(args.seed).shuffle(order)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, indices in (("heldout", order[: args.heldout]), ("train", order[args.heldout :])):
        rows = [{"prompt": task[i].text.strip(), "answer": task[i].answer} for i in indices]
        if args.data_source:
            for index, row in enumerate(rows):
                row.update(data_source=args.data_source, extra_info={"split": name, "index": index})
        with (args.out_dir / f"{name}.jsonl").open("a" if args.append else "w") as fh:
            fh.write("".join(json.dumps(r) + "\n" for r in rows))
        print(f"wrote {args.out_dir / name}.jsonl: {len(rows)} problems{' more' if args.append else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
