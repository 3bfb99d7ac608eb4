#!/usr/bin/env python
"""Fused chunked log-prob/entropy vs the naive full-logits computation: time and peak memory of
forward + backward, for growing token counts T at a given hidden size H and vocab V.

    python tools/bench_logprob.py --tokens 512 1024 2048 4096 --hidden 256 --vocab 32000 [--dtype float32]
    python tools/bench_logprob.py --tokens 16384 --hidden 3584 --vocab 151936 --dtype bfloat16 --device cuda

naive: logits = hidden @ W^T, then log_softmax and entropy in fp32 over the full [T, V] (what a plain head
does). fused: dapo_mcore.mcore.fused_logprobs.chunked_logprobs with --chunk tokens per chunk (logits
recomputed in backward: old log-probs, any loss). fused-lossgrad: chunked_logprobs_with_loss_grad, the
actor's default head for DAPO's loss (the gradient taken in the forward chunk loop, no recompute; no
entropy term in the loss, so its one-buffer path). Peak memory
is measured beyond the inputs: on CUDA with torch.cuda.max_memory_allocated; on the CPU as the growth of
the process's peak RSS, each case in a fresh process so that one case's peak cannot hide another's.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from dapo_mcore.mcore.fused_logprobs import chunked_logprobs, chunked_logprobs_with_loss_grad

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def naive(hidden, weight, labels):
    logp = torch.log_softmax((hidden @ weight.t()).float(), dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def fused(hidden, weight, labels, chunk):
    return chunked_logprobs(hidden, weight, labels, vocab_start=0, true_vocab=weight.shape[0], chunk=chunk)


def fused_lossgrad(hidden, weight, labels, chunk):
    """The same objective as the others' sum(log p): dL/dlogp = 1 per token, the entropy a metric only."""

    def loss_grad(a, b, logp_c, entropy_c):
        return torch.ones_like(logp_c), None

    _logp, _entropy, anchor = chunked_logprobs_with_loss_grad(
        hidden, weight, labels, loss_grad, vocab_start=0, true_vocab=weight.shape[0], chunk=chunk, entropy_grad=False
    )
    return anchor  # its gradient is that of sum(log p)


def loss_of(method, hidden, weight, labels, chunk):
    if method == "fused-lossgrad":
        return fused_lossgrad(hidden, weight, labels, chunk)
    logp, ent = naive(hidden, weight, labels) if method == "naive" else fused(hidden, weight, labels, chunk)
    return logp.sum() + 0.01 * ent.sum()


METHODS = ("naive", "fused", "fused-lossgrad")


def run_case(
    method: str, tokens: int, hidden_size: int, vocab: int, dtype: str, device: str, chunk: int, repeats: int
) -> dict:
    torch.manual_seed(0)
    dt = DTYPES[dtype]
    hidden = (torch.randn(tokens, hidden_size, device=device) * 0.1).to(dt).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, device=device) * 0.02).to(dt).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device=device)

    def step():
        loss_of(method, hidden, weight, labels, chunk).backward()
        hidden.grad = weight.grad = None

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        step()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    return {"method": method, "tokens": tokens, "seconds": (time.perf_counter() - start) / repeats, "peak_bytes": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="naive is always run")
    ap.add_argument("--worker", nargs=2, metavar=("METHOD", "TOKENS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        method, tokens = args.worker[0], int(args.worker[1])
        print(
            json.dumps(
                run_case(method, tokens, args.hidden, args.vocab, args.dtype, args.device, args.chunk, args.repeats)
            )
        )
        return
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(
        f"H={args.hidden} V={args.vocab} {args.dtype} on {device_name}, chunk={args.chunk}, forward+backward, "
        f"peak memory beyond the inputs"
    )
    fused_methods = [m for m in args.methods if m != "naive"]
    head = "".join(f" {m} s | {m} peak MiB | memory naive/{m} | time {m}/naive |" for m in fused_methods)
    print(f"| T | naive s | naive peak MiB |{head}")
    print("|---|---|---|" + "---|---|---|---|" * len(fused_methods))
    for tokens in args.tokens:
        base = measure(args, "naive", tokens)
        cells = f"| {tokens} | {base['seconds']:.3f} | {base['peak_bytes'] / 2**20:.0f} |"
        for method in fused_methods:
            row = measure(args, method, tokens)
            cells += (
                f" {row['seconds']:.3f} | {row['peak_bytes'] / 2**20:.0f} | "
                f"{base['peak_bytes'] / max(row['peak_bytes'], 1):.1f}x | {row['seconds'] / base['seconds']:.2f} |"
            )
        print(cells, flush=True)


def measure(args, method: str, tokens: int) -> dict:
    """One case in a fresh process (so the CPU's peak RSS belongs to that case alone)."""
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        method,
        str(tokens),
        "--hidden",
        str(args.hidden),
        "--vocab",
        str(args.vocab),
        "--dtype",
        args.dtype,
        "--device",
        args.device,
        "--chunk",
        str(args.chunk),
        "--repeats",
        str(args.repeats),
    ]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
