#!/usr/bin/env python
"""Weight push (actor -> engine) time and peak extra memory per bucket size, against the floor: copying the
same bytes once.

    python tools/bench_weight_sync.py [--model DIR] [--engine vllm] [--bucket-mb 1 8 64 512] [--repeats 3]

Each bucket size runs in a fresh process: the run is built by `build_run` (Megatron actor + engine, as in
training), then the push is timed (`WeightExporter.push`, the trainer's path: TP/PP gather, HF renaming,
buckets, the engine's in-place load). Peak extra memory is the highest resident-set size sampled every
millisecond during the first push, minus the size just before it (on a GPU: torch's peak allocation
during the push). The floor is one copy of every weight into a buffer allocated beforehand, timed in the
same process.
Without --model the benchmark model of tools/bench_rollout.py is made (~25M parameters).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))


class PeakRSS:
    """Highest resident-set size seen by a 1 ms sampling thread while the block runs."""

    def __enter__(self):
        self.proc, self.peak, self.running = psutil.Process(), 0, True
        self.before = self.proc.memory_info().rss
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def extra_mib(self) -> float:
        return (self.peak - self.before) / 2**20


class PeakCUDA:
    """Torch's peak GPU allocation during the block, above what was allocated before it."""

    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.before = torch.cuda.memory_allocated()
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize()
        self.extra_mib = (torch.cuda.max_memory_allocated() - self.before) / 2**20


def run_case(args) -> dict:
    from dapo_mcore.build import build_run
    from dapo_mcore.config import load_config
    from dapo_mcore.trainer import finish

    with tempfile.TemporaryDirectory() as tmp:
        overrides = [
            f"model.hf_path={args.model}",
            f"rollout.engine={args.engine}",
            f"parallel.device={args.device}",
            f"model.dtype={args.dtype}",
            f"rollout.weight_bucket_mb={args.case_bucket_mb}",
            f"rollout.verify_weights={str(args.verify).lower()}",
            f"logging.run_dir={tmp}/run",
            "logging.wandb.mode=disabled",
            "logging.progress=false",
        ]
        run = build_run(load_config(str(REPO / "examples/smoke_cpu.yaml"), overrides))
        try:
            weights = [p.detach() for chunk in run.actor.chunks for p in chunk.parameters()]
            nbytes = sum(w.numel() * w.element_size() for w in weights)
            with PeakRSS() if run.ctx.device.type == "cpu" else PeakCUDA() as peak:
                run.exporter.push(run.engine, verify=args.verify)
            push_s = timed(lambda: run.exporter.push(run.engine, verify=args.verify), args.repeats)
            flat = torch.empty(sum(w.numel() for w in weights), dtype=weights[0].dtype, device=weights[0].device)
            torch.cat([w.reshape(-1) for w in weights], out=flat)  # first touch of the buffer, not timed
            floor_s = timed(lambda: torch.cat([w.reshape(-1) for w in weights], out=flat), args.repeats)
        finally:
            finish(run)
    return {
        "bucket_mb": args.case_bucket_mb,
        "bytes": nbytes,
        "push_s": push_s,
        "floor_s": floor_s,
        "extra_mib": peak.extra_mib,
    }


def timed(fn, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--engine", default="vllm", choices=["hf", "vllm", "sglang"])
    ap.add_argument("--bucket-mb", type=int, nargs="+", default=[1, 8, 64, 512])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--verify", action="store_true", help="with rollout.verify_weights (checksums)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    ap.add_argument("--case-bucket-mb", type=int, help=argparse.SUPPRESS)  # one case, in this process
    args = ap.parse_args()
    if args.case_bucket_mb:
        print(json.dumps(run_case(args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if not args.model:
            from bench_rollout import make_model

            args.model = str(make_model(Path(tmp) / "model"))
        rows = [measure(args, mb) for mb in args.bucket_mb]
    print(
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}; engine {args.engine}, "
        f"{rows[0]['bytes'] / 2**20:.0f} MiB of weights, verify={args.verify}, {args.repeats} repeats"
    )
    print("| bucket MiB | push s | floor s (one copy) | push / floor | peak extra MiB |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['bucket_mb']} | {r['push_s']:.3f} | {r['floor_s']:.3f} | {r['push_s'] / r['floor_s']:.1f}x | "
            f"{r['extra_mib']:.0f} |"
        )


def measure(args, bucket_mb: int) -> dict:
    from bench_rollout import case_in_fresh_process

    case_args = ["--model", args.model, "--engine", args.engine, "--repeats", str(args.repeats)]
    case_args += ["--case-bucket-mb", str(bucket_mb), "--device", args.device, "--dtype", args.dtype]
    case_args += ["--verify"] if args.verify else []
    return case_in_fresh_process(__file__, case_args, f"bucket {bucket_mb} MiB")


if __name__ == "__main__":
    main()
