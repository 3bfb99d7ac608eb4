#!/usr/bin/env python
"""SGLang's streamed answers read by the adapter: the cumulative way (before incremental streaming, each chunk
carried the whole output so far and the adapter copied it) against StreamedAnswers (each chunk's new tokens
appended), on one simulated answer of N tokens, one token a chunk, both timed in the same run.

    python tools/bench_sglang_stream.py [--tokens 1000 4000 20000]
"""

from __future__ import annotations

import argparse
import time

from dapo_mcore.rollout.sglang_engine import StreamedAnswers


def cumulative_s(n: int) -> float:
    """The old reading: every chunk's full output and log-probs copied into the answer."""
    out_ids, logprobs_so_far = [], []
    start = time.perf_counter()
    for k in range(n):
        out_ids.append(3 + k % 90)
        logprobs_so_far.append((-0.001 * k, 0, None))
        tokens = list(out_ids)
        _ = [float(entry[0]) for entry in logprobs_so_far][: len(tokens)]
    return time.perf_counter() - start


def incremental_s(n: int) -> float:
    chunks = [
        {
            "index": 0,
            "output_ids": [3 + k % 90],
            "meta_info": {"completion_tokens": k + 1, "output_token_logprobs": [(-0.001 * k, 0, None)]},
        }
        for k in range(n)
    ]
    answers = StreamedAnswers(1)
    start = time.perf_counter()
    for chunk in chunks:
        answers.add(chunk)
    took = time.perf_counter() - start
    assert len(answers.tokens[0]) == n
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1000, 4000, 20000])
    args = ap.parse_args()
    print("| answer tokens | cumulative (s) | incremental (s) | cumulative / incremental |")
    print("|---|---|---|---|")
    for n in args.tokens:
        old, new = cumulative_s(n), incremental_s(n)
        print(f"| {n} | {old:.3f} | {new:.4f} | {old / new:.0f}x |")


if __name__ == "__main__":
    main()
