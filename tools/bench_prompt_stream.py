#!/usr/bin/env python
"""The prompt stream's first prompts from a large arithmetic grid: a shuffled list of every index (what
PromptStream did for any source before issue 21) against the per-index Feistel permutation it uses now for
sources over 2^20 prompts. Both measured in this run: seconds to the first prompts and the growth of the
process's resident memory.

    python tools/bench_prompt_stream.py [--min-operand 5000 --max-operand 9000 --take 64]
"""

import argparse
import random
import time

import psutil

from dapo_mcore.data.arithmetic import ArithmeticTask
from dapo_mcore.data.datasets import FeistelPermutation


def measure(make_order, task, take):
    rss_before = psutil.Process().memory_info().rss
    start = time.perf_counter()
    order = make_order(len(task))
    prompts = [task[order[i]] for i in range(take)]
    seconds = time.perf_counter() - start
    grown = psutil.Process().memory_info().rss - rss_before
    del order
    return seconds, grown / 2**20, len(prompts)


def shuffled_list(n):
    order = list(range(n))
    random.Random("0/0").shuffle(order)
    return order


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--min-operand", type=int, default=5000)
    ap.add_argument("--max-operand", type=int, default=9000)
    ap.add_argument("--take", type=int, default=64)
    args = ap.parse_args()
    task = ArithmeticTask(args.min_operand, args.max_operand)
    print(f"grid of {len(task):,} problems, first {args.take} prompts")
    results = {}
    for name, make in (("feistel", lambda n: FeistelPermutation(n, "0/0")), ("shuffled list", shuffled_list)):
        results[name] = measure(make, task, args.take)
        print(f"{name:14s} {results[name][0]:8.3f} s  {results[name][1]:9.1f} MiB more resident")
    (list_s, list_mib, _), (feistel_s, feistel_mib, _) = results["shuffled list"], results["feistel"]
    print(f"list / feistel: {list_s / feistel_s:,.0f}x the time; {list_mib:,.0f} vs {feistel_mib:,.1f} MiB")


if __name__ == "__main__":
    main()
