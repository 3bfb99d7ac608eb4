#!/usr/bin/env python
"""Time torch.optim.AdamW's step on the CPU, fused and unfused, at given parameter and thread counts: the step
optimizer.cpu_offload runs (Megatron-Core's HybridDeviceOptimizer steps its host share with AdamW, fused=True).

    python tools/bench_cpu_adam.py --params-m 500 --threads 16 --out FILE.json
    python tools/bench_cpu_adam.py --params-m 50 --threads 1 2

The parameters are fp32, split into tensors of --tensor-m million (Megatron's distributed-optimizer shards
are many tensors; the fused kernel takes them as one list). One untimed step first allocates Adam's moments,
then --repeats timed steps; the table gives the fastest and the median, ns a parameter, and fused over unfused
measured in the same run. Unfused is torch's CPU default (fused=None, foreach=None: the single-tensor loop).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

VARIANTS = {"unfused": {}, "fused": {"fused": True}}


def make_params(params: int, tensor: int) -> list[torch.Tensor]:
    sizes = [tensor] * (params // tensor) + ([params % tensor] if params % tensor else [])
    out = []
    for size in sizes:
        p = torch.nn.Parameter(torch.randn(size) * 0.02)
        p.grad = torch.randn(size) * 1e-3
        out.append(p)
    return out


def time_step(params: list[torch.Tensor], variant: str, threads: int, repeats: int) -> list[float]:
    """Seconds of each timed step of AdamW over `params` at `threads` intra-op threads (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        opt = torch.optim.AdamW(params, lr=1e-6, weight_decay=0.1, **VARIANTS[variant])
        opt.step()  # allocates exp_avg / exp_avg_sq: not what a training step pays
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - start)
        return times
    finally:
        torch.set_num_threads(before)


def run(params_m: float, threads: list[int], repeats: int, tensor_m: float) -> list[dict]:
    n, tensor = int(params_m * 1e6), max(1, int(tensor_m * 1e6))
    params = make_params(n, tensor)
    rows = []
    for t in threads:
        row: dict = {"params": n, "threads": t}
        for variant in VARIANTS:
            times = time_step(params, variant, t, repeats)
            row[variant] = {"min_s": min(times), "median_s": statistics.median(times), "times_s": times}
            row[variant]["ns_per_param"] = 1e9 * min(times) / n
        row["fused_over_unfused"] = row["fused"]["min_s"] / row["unfused"]["min_s"]
        rows.append(row)
    return rows


def machine() -> str:
    """The CPU's model name (Linux), its count of CPUs and torch's default thread count."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            name = next((line.split(":", 1)[1].strip() for line in fh if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads by default"


def print_table(rows: list[dict]) -> None:
    heads = ("params", "threads", "unfused s (median)", "fused s (median)", "unfused ns/param", "fused ns/param")
    print(f"| {' | '.join(heads)} | fused/unfused |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        u, f = r["unfused"], r["fused"]
        print(
            f"| {r['params'] / 1e6:g}M | {r['threads']} | {u['min_s']:.3f} ({u['median_s']:.3f}) | "
            f"{f['min_s']:.3f} ({f['median_s']:.3f}) | {u['ns_per_param']:.2f} | {f['ns_per_param']:.2f} | "
            f"{r['fused_over_unfused']:.3f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params-m", type=float, required=True, help="parameters, in millions")
    ap.add_argument("--threads", type=int, nargs="+", required=True, help="torch intra-op thread counts to time")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per case (default 3)")
    ap.add_argument("--tensor-m", type=float, default=16.0, help="millions of parameters a tensor (default 16)")
    ap.add_argument("--out", help="write the results as JSON here (default: printed only)")
    args = ap.parse_args()
    rows = run(args.params_m, args.threads, args.repeats, args.tensor_m)
    print(f"machine: {machine()}; torch {torch.__version__}; {args.repeats} timed steps a case, fastest (median)")
    print_table(rows)
    if args.out:
        result = {"machine": machine(), "torch": torch.__version__, "tensor_m": args.tensor_m, "rows": rows}
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
