"""A PNG of accuracy and response length over RL steps, and held-out avg@k when the run validates, redrawn
from metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from dapo_mcore.utils.metrics_log import read_metrics

_PANELS = (
    ("rollout/accuracy", "accuracy (all generated responses)"),
    ("rollout/response_len_mean", "mean response length (tokens)"),
)


def plot_run(metrics_path: Path, png_path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    held_out = sorted({key for row in rows for key in row if key.startswith("eval/") and "/avg@" in key})
    panels = [[(key, None)] for key, _ in _PANELS]
    titles = [label for _, label in _PANELS]
    if held_out:  # one line per held-out file
        panels.append([(key, key.split("/")[1]) for key in held_out])
        titles.append(f"held-out {held_out[0].rsplit('/', 1)[1]} (before the step's update)")
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6))
    for ax, lines, label in zip(axes, panels, titles):
        for key, legend in lines:
            points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if points:
                ax.plot(*zip(*points), marker="o", markersize=3, label=legend)
        if any(legend for _, legend in lines):
            ax.legend(fontsize=8)
        ax.set_xlabel("RL step")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
