"""A PNG of accuracy and response length over RL steps, redrawn from metrics.jsonl."""

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
    fig, axes = plt.subplots(1, len(_PANELS), figsize=(10, 3.6))
    for ax, (key, label) in zip(axes, _PANELS):
        points = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points), marker="o", markersize=3)
        ax.set_xlabel("RL step")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
