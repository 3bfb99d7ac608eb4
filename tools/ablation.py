#!/usr/bin/env python
"""Ablate DAPO on the CPU task: full DAPO, plain GRPO, and DAPO with each component removed, over seeds.

    python tools/ablation.py [--config examples/smoke_cpu.yaml] [--seeds 0 1 2] [--variants dapo grpo ...]
                             [--target 0.6] [--runs-dir runs/ablation] [--out docs/ablation.md] [--plot PNG]
                             [--eval-file examples/data/sums.jsonl --eval-interval 10 --eval-k 16]

Each (variant, seed) is one `dapo-mcore train` process (the variants are the override sets in
dapo_mcore/config/presets.py; the seed sets rollout.seed and data.seed). A run whose metrics.jsonl already
holds every step is reused, so an interrupted ablation resumes. The results table and a plot are written
between the markers <!-- ablation:begin --> and <!-- ablation:end --> of --out; the text around them is kept.

Columns: steps until the 5-step moving average of accuracy first reaches --target; final accuracy and response
length (mean of the last 5 steps); generated samples per trained sample (the cost of dynamic sampling); where the
runs log them, how often the clips acted (actor/clip_frac_high, _low, dual_clip_frac) and the entropy, as the mean
over the run's steps, and the entropy of its last 5 steps. Each is the mean ± std over seeds. Each variant's
held-out curve (by step, over seeds and per seed) follows the table. With --eval-file, each run also validates on
that held-out file with its current weights (avg@k at the rollout's temperature and top-p, so no sampler's
bookkeeping enters it) every --eval-interval steps and after the last; the table adds the mean of the last three.
Without it, a recipe's own held-out files (data.eval_files) are read the same way, by its own verifier (not its
trainer.eval_also_verifiers rules, nor the per-source rows).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dapo_mcore.config import load_config
from dapo_mcore.config.presets import ABLATIONS, LOSS_VARIANTS, ROLLOUT_VARIANTS

VARIANTS = {**ABLATIONS, **ROLLOUT_VARIANTS, **LOSS_VARIANTS}

BEGIN, END = "<!-- ablation:begin -->", "<!-- ablation:end -->"
WINDOW = 5
# Held-out accuracy is the mean of the last evaluations (one alone swings with the last update).
HELD_OUT_EVALS = 3


def eval_overrides(config: str, eval_file: str | None, interval: int, k: int) -> list[str]:
    """Validation on eval_file at the rollout's own sampling settings (the rollout accuracy's conditions)."""
    if not eval_file:
        return []
    sampling = load_config(config).rollout.sampling
    return [
        f"data.eval_files={eval_file}",
        f"trainer.eval_interval={interval}",
        f"trainer.eval_k={k}",
        f"trainer.eval_temperature={sampling.temperature}",
        f"trainer.eval_top_p={sampling.top_p}",
    ]


def run_one(config: str, variant: str, seed: int, runs_dir: Path, extra: list[str]) -> Path:
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
        *extra,
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


# The actor's figures the table adds (each a mean over the run's steps) where the runs log them: how often
# clip-higher's upper bound, the lower bound and the dual clip acted, and the policy's entropy.
ACTOR_COLUMNS = {
    "actor/clip_frac_high": "clip-high fraction",
    "actor/clip_frac_low": "clip-low fraction",
    "actor/dual_clip_frac": "dual-clip fraction",
    "actor/entropy": "entropy",
}


def is_held_out(key: str) -> bool:
    """eval/<file>/avg@k of the run's own verifier: not an also-rule's (eval/<file>:<rule>/...), nor a source's
    (eval/<file>[<source>]/...)."""
    if not key.startswith("eval/") or "/avg@" not in key:
        return False
    label = key.split("/")[1]
    return ":" not in label and "[" not in label


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
    trained = sum(r.get("dynamic_sampling/kept_groups", 0) * group_size for r in rows)
    held_out = [v for r in rows for k, v in r.items() if is_held_out(k)]
    held_out_steps = [r["step"] for r in rows for k in r if is_held_out(k)]
    actor = {key: [r[key] for r in rows if key in r] for key in ACTOR_COLUMNS}
    return {
        **{key: statistics.mean(values) if values else None for key, values in actor.items()},
        "entropy": actor["actor/entropy"],
        "final_entropy": statistics.mean(actor["actor/entropy"][-WINDOW:]) if actor["actor/entropy"] else None,
        "held_out": held_out,
        "held_out_steps": held_out_steps,
        "held_out_accuracy": statistics.mean(held_out[-HELD_OUT_EVALS:]) if held_out else None,
        "steps_to_target": reached,
        "final_accuracy": statistics.mean(acc[-WINDOW:]),
        "final_length": statistics.mean(lengths[-WINDOW:]),
        "generated_per_trained": generated / max(trained, 1),
        "accuracy": acc,
        "generated": cumulative,
        "length": lengths,
        # by step: a step that trained only groups carried over from the one before generated nothing
        "accuracy_by_step": {r["step"]: r["rollout/accuracy"] for r in rows if "rollout/accuracy" in r},
        "length_by_step": {r["step"]: r["rollout/response_len_mean"] for r in rows if "rollout/response_len_mean" in r},
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
    held_out = any(r["held_out_accuracy"] is not None for runs in results.values() for r in runs)
    extra_head, extra_rule = (" held-out accuracy, last 3 evals |", "---|") if held_out else ("", "")
    actor = [key for key in ACTOR_COLUMNS if any(r[key] is not None for rs in results.values() for r in rs)]
    extra_head += "".join(f" {ACTOR_COLUMNS[key]} (mean of steps) |" for key in actor)
    extra_rule += "---|" * len(actor)
    if "actor/entropy" in actor:
        extra_head, extra_rule = extra_head + " entropy, last 5 steps |", extra_rule + "---|"
    lines = [
        f"| variant | steps to accuracy {target} | final accuracy | final length | generated / trained |{extra_head}",
        f"|---|---|---|---|---|{extra_rule}",
    ]
    for variant, runs in results.items():
        row = (
            f"| {variant} | {mean_std([r['steps_to_target'] for r in runs], '{:.1f}')} | "
            f"{mean_std([r['final_accuracy'] for r in runs], '{:.3f}')} | "
            f"{mean_std([r['final_length'] for r in runs], '{:.1f}')} | "
            f"{mean_std([r['generated_per_trained'] for r in runs], '{:.2f}')} |"
        )
        if held_out:
            row += f" {mean_std([r['held_out_accuracy'] for r in runs], '{:.3f}')} |"
        # a figure a variant does not log (the dual clip, switched off) is "off", not "never"
        row += "".join(
            f" {mean_std([r[key] for r in runs], '{:.4f}') if any(r[key] is not None for r in runs) else 'off'} |"
            for key in actor
        )
        if "actor/entropy" in actor:
            row += f" {mean_std([r['final_entropy'] for r in runs], '{:.3f}')} |"
        lines.append(row)
    return "\n".join(lines)


def held_out_curves(results: dict[str, list[dict]]) -> str:
    """Each variant's held-out accuracy at each evaluation, the mean over seeds (and each seed's)."""
    lines = []
    for variant, runs in results.items():
        evals = min(len(r["held_out"]) for r in runs)
        if not evals:
            continue
        points = []
        for i in range(evals):
            each = ", ".join(f"{r['held_out'][i]:.3f}" for r in runs)
            points.append(f"{runs[0]['held_out_steps'][i]}: {statistics.mean(r['held_out'][i] for r in runs):.3f} "
                          f"({each})")  # fmt: skip
        lines.append(f"- {variant}, held-out accuracy by step (mean over seeds, then each seed): {'; '.join(points)}")
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    held_out = all(r["held_out"] for runs in results.values() for r in runs)
    entropy = all(r["entropy"] for runs in results.values() for r in runs)
    panels = 3 + held_out + entropy
    fig, axes = plt.subplots(1, panels, figsize=(5.3 * panels, 4.2))
    for variant, runs in results.items():
        width = 2 if variant in ("dapo", "grpo") else 1
        for ax, key in zip(axes, ("accuracy_by_step", "length_by_step")):
            steps = sorted({step for r in runs for step in r[key]})  # step N: N updates done
            mean = [statistics.mean(r[key][step] for r in runs if step in r[key]) for step in steps]
            ax.plot(steps, mean, label=variant, linewidth=width)
        steps = min(len(r["accuracy"]) for r in runs)
        generated = [statistics.mean(r["generated"][i] for r in runs) for i in range(steps)]
        accuracy = [statistics.mean(r["accuracy"][i] for r in runs) for i in range(steps)]
        axes[2].plot(generated, accuracy, label=variant, linewidth=width)
        if held_out:
            evals = min(len(r["held_out"]) for r in runs)
            mean = [statistics.mean(r["held_out"][i] for r in runs) for i in range(evals)]
            axes[3].plot(runs[0]["held_out_steps"][:evals], mean, label=variant, linewidth=width, marker="o")
        if entropy:
            steps = min(len(r["entropy"]) for r in runs)
            mean = [statistics.mean(r["entropy"][i] for r in runs) for i in range(steps)]
            axes[-1].plot(range(1, steps + 1), mean, label=variant, linewidth=width)
    axes[0].set_title("accuracy (mean over seeds)")
    axes[1].set_title("mean response length (tokens)")
    axes[2].set_title("accuracy vs samples generated (the same cost)")
    if held_out:
        axes[3].set_title("held-out accuracy, current weights (mean over seeds)")
    if entropy:
        axes[-1].set_title("policy entropy, nats per token (mean over seeds)")
    for ax, xlabel in zip(axes, ("RL step", "RL step", "responses generated so far", "RL step", "RL step")):
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


def command_options(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The options that made this table, those left at their defaults aside (a command to run it again)."""
    options = []
    for action in ap._actions:
        value = getattr(args, action.dest, None)
        if not action.option_strings or value is None or value == action.default:
            continue
        shown = " ".join(map(str, value)) if isinstance(value, list) else str(value)
        options.append(f"{action.option_strings[0]} {shown}")
    return options


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="examples/smoke_cpu.yaml")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", default=list(ABLATIONS), choices=list(VARIANTS))
    ap.add_argument("--target", type=float, default=0.6)
    ap.add_argument("--runs-dir", type=Path, default=Path("runs/ablation"))
    ap.add_argument("--out", type=Path, default=Path("docs/ablation.md"))
    ap.add_argument("--plot", type=Path, help="the figure (default: beside --out, its name with .png)")
    ap.add_argument("--eval-file", help="held-out .jsonl validated with each run's current weights")
    ap.add_argument("--eval-interval", type=int, default=10)
    ap.add_argument("--eval-k", type=int, default=16)
    args = ap.parse_args()
    group_size = load_config(args.config).rollout.n_samples_per_prompt
    extra = eval_overrides(args.config, args.eval_file, args.eval_interval, args.eval_k)
    results = {
        v: [summarize(run_one(args.config, v, s, args.runs_dir, extra), args.target, group_size) for s in args.seeds]
        for v in args.variants
    }
    png = args.plot or args.out.with_name(args.out.stem + ".png")
    plot(results, png)
    curves = held_out_curves(results)
    section = (
        f"Command: `python tools/ablation.py {' '.join(command_options(ap, args))}` "
        f"on {platform.machine()} ({platform.processor() or 'CPU'}), {time.strftime('%Y-%m-%d')}.\n\n"
        f"{table(results, args.target)}\n\n{curves + chr(10) + chr(10) if curves else ''}"
        f"![accuracy and length by variant]({os.path.relpath(png, args.out.parent)})"
    )
    write_section(args.out, section)
    print(table(results, args.target))


if __name__ == "__main__":
    main()
