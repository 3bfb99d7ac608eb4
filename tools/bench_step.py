#!/usr/bin/env python
"""Time one RL step split into its phases: generate / reward / old log-probs / update / weight push.

    python tools/bench_step.py [CONFIG] [section.key=value ...] [--steps 5] [--warmup 1]

Runs the config's real pieces (engine, Megatron actor, exporter) for warm-up + timed steps and prints a
markdown table of the mean seconds per phase and each phase's share of the step. Nothing is written to
runs/ (the run directory is a temporary one). Works under torchrun for parallel layouts.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile

import torch

from dapo_mcore.build import build_run
from dapo_mcore.config import load_config
from dapo_mcore.trainer import finish, rl_step

PHASES = ("generate", "reward", "old_logprobs", "update", "weight_push")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", default="examples/smoke_cpu.yaml")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            args.config,
            [
                *args.overrides,
                f"logging.run_dir={tmp}/run",
                "logging.wandb.mode=disabled",
                "logging.progress=false",
                f"trainer.steps={args.warmup + args.steps}",
            ],
        )
        run = build_run(cfg)
        try:
            run.exporter.push(run.engine)
            rows = [rl_step(run, step) for step in range(args.warmup + args.steps)][args.warmup :]
            if run.ctx.rank == 0:
                print_table(cfg, run.ctx.describe(), rows)
        finally:
            finish(run)


def print_table(cfg, layout: str, rows: list[dict[str, float]]) -> None:
    step_s = statistics.mean(r["time/step_s"] for r in rows)
    print(
        f"config: {cfg.name} | {layout} | {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} torch threads | {len(rows)} timed steps"
    )
    print(
        f"samples per step: {statistics.mean(r.get('rollout/generated_samples', 0) for r in rows):.0f} generated, "
        f"{statistics.mean(r['actor/train_tokens'] for r in rows):.0f} trained tokens"
    )
    print("| phase | mean s | share of step |\n|---|---|---|")
    for phase in PHASES:
        secs = statistics.mean(r.get(f"time/{phase}_s", 0.0) for r in rows)
        print(f"| {phase} | {secs:.3f} | {secs / step_s:.1%} |")
    print(f"| **step** | {step_s:.3f} | 100% |")


if __name__ == "__main__":
    main()
