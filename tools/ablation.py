#!/usr/bin/env python
"""Ablate DAPO on the CPU task: full DAPO, plain GRPO, and DAPO with each component removed, over seeds.

    python tools/ablation.py [--config examples/smoke_cpu.yaml] [--seeds 0 1 2] [--variants dapo grpo ...]
                             [--target 0.6] [--runs-dir runs/ablation] [--out docs/ablation.md]

Each (variant, seed) is one `dapo-mcore train` process (the variants are the override sets in
dapo_mcore/config/presets.py; the seed sets rollout.seed and data.seed). A run whose metrics.jsonl already
holds every step is reused, so an interrupted ablation resumes. The results table and a plot are written
between the markers <!-- ablation:begin --> and <!-- ablation:end --> of --out; the text around them is kept.

Columns: steps until the 5-step moving average of accuracy first reaches --target; final accuracy and
response length (mean of the last 5 steps); generated samples per trained sample (the cost of dynamic
sampling). Each is the mean ± std over seeds.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dapo_mcore.config import load_config
from dapo_mcore.config.presets import ABLATIONS, ROLLOUT_VARIANTS

VARIANTS = {**ABLATIONS, **ROLLOUT_VARIANTS}

BEGIN, END = "<!-- ablation:begin -->", "<!-- ablation:end -->"
WINDOW = 5


def run_one(config: str, variant: str, seed: int, runs_dir: Path) -> Path:
    run_dir = runs_dir / f"{variant}-s{seed}"
    steps = load_config(config).trainer.steps
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
        return run_dir
    cmd = [
        sys.executable,
        "-m",
        "dapo_mcore.cli",
        "train",
        config,
        *VARIANTS[variant],
        f"rollout.seed={seed}",
        f"data.seed={seed}",
        f"logging.run_dir={run_dir}",
        "logging.wandb.mode=disabled",
        "logging.progress=false",
    ]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} seed {seed} failed:\n{proc.stderr[-3000:]}")
    print(f"{variant:>22} seed {seed}: {time.time() - start:.0f} s", flush=True)
    return run_dir


def summarize(run_dir: Path, target: float, group_size: int) -> dict[str, float | None]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    acc = [r["rollout/accuracy"] for r in rows if "rollout/accuracy" in r]
    lengths = [r["rollout/response_len_mean"] for r in rows if "rollout/response_len_mean" in r]
    moving = [statistics.mean(acc[max(0, i - WINDOW + 1) : i + 1]) for i in range(len(acc))]
    reached = next((i + 1 for i, a in enumerate(moving) if i >= WINDOW - 1 and a >= target), None)
    generated = sum(r.get("rollout/generated_samples", 0.0) for r in rows)
    cumulative, total = [], 0.0
    for r in rows:
        if "rollout/accuracy" in r:
            total += r.get("rollout/generated_samples", 0.0)
            cumulative.append(total)
    trained = sum(r["dynamic_sampling/kept_groups"] * group_size for r in rows)
    return {
        "steps_to_target": reached,
        "final_accuracy": statistics.mean(acc[-WINDOW:]),
        "final_length": statistics.mean(lengths[-WINDOW:]),
        "generated_per_trained": generated / max(trained, 1),
        "accuracy": acc,
        "generated": cumulative,
        "length": lengths,
    }


def mean_std(values: list[float | None], fmt: str) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "never"
    text = fmt.format(statistics.mean(known))
    if len(known) > 1:
        text += " ± " + fmt.format(statistics.stdev(known))
    missing = len(values) - len(known)
    return text + (f" ({missing} of {len(values)} never)" if missing else "")


def table(results: dict[str, list[dict]], target: float) -> str:
    lines = [
        f"| variant | steps to accuracy {target} | final accuracy | final length | generated / trained |",
        "|---|---|---|---|---|",
    ]
    for variant, runs in results.items():
        lines.append(
            f"| {variant} | {mean_std([r['steps_to_target'] for r in runs], '{:.1f}')} | "
            f"{mean_std([r['final_accuracy'] for r in runs], '{:.3f}')} | "
            f"{mean_std([r['final_length'] for r in runs], '{:.1f}')} | "
            f"{mean_std([r['generated_per_trained'] for r in runs], '{:.2f}')} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for variant, runs in results.items():
        width = 2 if variant in ("dapo", "grpo") else 1
        steps = min(len(r["accuracy"]) for r in runs)
        for ax, key in zip(axes, ("accuracy", "length")):
            mean = [statistics.mean(r[key][i] for r in runs) for i in range(steps)]
            ax.plot(range(steps), mean, label=variant, linewidth=width)
        generated = [statistics.mean(r["generated"][i] for r in runs) for i in range(steps)]
        accuracy = [statistics.mean(r["accuracy"][i] for r in runs) for i in range(steps)]
        axes[2].plot(generated, accuracy, label=variant, linewidth=width)
    axes[0].set_title("accuracy (mean over seeds)")
    axes[1].set_title("mean response length (tokens)")
    axes[2].set_title("accuracy vs samples generated (the same cost)")
    for ax, xlabel in zip(axes, ("RL step", "RL step", "responses generated so far")):
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def write_section(out: Path, section: str) -> None:
    text = out.read_text() if out.exists() else f"# Ablation\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        text += f"\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    out.write_text(f"{head}{BEGIN}\n{section}\n{END}{rest.split(END, 1)[1]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="examples/smoke_cpu.yaml")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", default=list(ABLATIONS), choices=list(VARIANTS))
    ap.add_argument("--target", type=float, default=0.6)
    ap.add_argument("--runs-dir", type=Path, default=Path("runs/ablation"))
    ap.add_argument("--out", type=Path, default=Path("docs/ablation.md"))
    args = ap.parse_args()
    group_size = load_config(args.config).rollout.n_samples_per_prompt
    results = {
        v: [summarize(run_one(args.config, v, s, args.runs_dir), args.target, group_size) for s in args.seeds]
        for v in args.variants
    }
    png = args.out.with_name(args.out.stem + ".png")
    plot(results, png)
    section = (
        f"Command: `python tools/ablation.py --config {args.config} --seeds {' '.join(map(str, args.seeds))}"
        f"{'' if args.variants == list(ABLATIONS) else ' --variants ' + ' '.join(args.variants)}` "
        f"on {platform.machine()} ({platform.processor() or 'CPU'}), {time.strftime('%Y-%m-%d')}.\n\n"
        f"{table(results, args.target)}\n\n![accuracy and length by variant]({png.name})"
    )
    write_section(args.out, section)
    print(table(results, args.target))


if __name__ == "__main__":
    main()
