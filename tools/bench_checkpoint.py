#!/usr/bin/env python
"""Time a run checkpoint's save and load, and report its size, for a config's model and optimizer.

    python tools/bench_checkpoint.py [CONFIG] [section.key=value ...] [--repeats 5]

After one RL step (so Adam has its state), saves the run checkpoint `--repeats` times and loads it back as
many times, through the trainer's CheckpointManager. Baseline, measured in the same run: torch.save of this
rank's model state dict and torch Adam state to one file (what a single-process trainer would do; neither
atomic nor reshardable). Also times the CRC-32 of every file of the save (part of each save) and the check a
resume makes before loading (sizes + CRC-32). Prints a markdown table. Works under torchrun for parallel layouts.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from dapo_mcore.build import build_run
from dapo_mcore.checkpoint.model_checkpoint import dir_bytes, file_crc32, verify_complete
from dapo_mcore.config import load_config
from dapo_mcore.mcore.sharding import unwrap
from dapo_mcore.trainer import finish, rl_step


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", default="examples/smoke_cpu.yaml")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    # one directory for all ranks (saves are collective): named after the rendezvous port torchrun shares
    tmp = Path(tempfile.gettempdir()) / f"dapo-bench-checkpoint-{os.environ.get('MASTER_PORT', 'single')}"
    try:
        cfg = load_config(
            args.config,
            [
                *args.overrides,
                f"logging.run_dir={tmp}/run",
                "logging.wandb.mode=disabled",
                "logging.progress=false",
                "checkpoint.keep_last=1",
                f"checkpoint.dir={tmp}/checkpoints",  # never a recipe's own directory
                "checkpoint.resume=none",
            ],
        )
        run = build_run(cfg)
        try:
            run.exporter.push(run.engine)
            rl_step(run, 0)
            state = {"sampler": run.sampler.state_dict(), "wandb_run_id": None}
            saves, completes = [], []  # training is blocked for `saves`; + `completes` until the save is complete
            for _ in range(args.repeats):
                saves.append(timed(lambda: run.checkpoints.save(1, run.actor, run.spec, state)))
                completes.append(timed(run.checkpoints.wait))  # 0 unless checkpoint.async_save
            path = run.checkpoints.root / "step_000001"
            loads = [timed(lambda: run.checkpoints.load(path, run.actor, run.spec)) for _ in range(args.repeats)]
            files = [f for f in path.rglob("*") if f.is_file()]
            crcs = [timed(lambda: [file_crc32(f) for f in files]) for _ in range(args.repeats)]  # inside a save
            verifies = [timed(lambda: verify_complete(path, checksums=True)) for _ in range(args.repeats)]
            plain = Path(tmp) / f"plain_{run.ctx.rank}.pt"
            inner = [sub.optimizer for sub in getattr(run.actor.optimizer, "chained_optimizers", [run.actor.optimizer])]
            model_and_optimizer = lambda: torch.save(  # noqa: E731
                {
                    "model": [unwrap(c).state_dict() for c in run.actor.chunks],
                    "optimizer": [opt.state_dict() for opt in inner],  # Adam moments of this rank's shard
                },
                plain,
            )
            baseline = [timed(model_and_optimizer) for _ in range(args.repeats)]
            if run.ctx.rank == 0:
                timings = {"saves": saves, "completes": completes, "loads": loads, "crcs": crcs, "verifies": verifies}
                report(cfg, run, timings, baseline, dir_bytes(path), plain.stat().st_size)
        finally:
            finish(run)
    finally:
        if os.environ.get("RANK", "0") == "0":
            shutil.rmtree(tmp, ignore_errors=True)


def report(cfg, run, timings, baseline, size, plain_size) -> None:
    params = sum(p.numel() for c in run.actor.chunks for p in c.parameters())
    base = statistics.median(baseline)
    saves, completes, loads = timings["saves"], timings["completes"], timings["loads"]
    print(
        f"config: {cfg.name} | {run.ctx.describe()} | {platform.processor() or platform.machine()} | "
        f"{params:,} parameters on rank 0 | median of {len(saves)}"
    )
    rows = [
        ("run checkpoint save: training blocked", statistics.median(saves), f"{size / 2**20:.2f} MiB"),
        ("run checkpoint save: until complete", statistics.median(a + b for a, b in zip(saves, completes)), ""),
        ("run checkpoint load", statistics.median(loads), ""),
        ("  of a save: CRC-32 of every file", statistics.median(timings["crcs"]), ""),
        ("  before a resume: verify sizes + CRC-32", statistics.median(timings["verifies"]), ""),
        ("baseline: torch.save of model + Adam state", base, f"{plain_size / 2**20:.2f} MiB"),
    ]
    print("| | median s | vs torch.save | size |\n|---|---|---|---|")
    for label, secs, where in rows:
        print(f"| {label} | {secs:.3f} | {secs / base:.1f}x | {where} |")


if __name__ == "__main__":
    main()
