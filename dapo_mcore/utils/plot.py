"""Plots of a run, redrawn from its metrics.jsonl: the default grid of what to watch in a DAPO run (the
trainer's curves.png), or one panel per metric asked for (`dapo-mcore plot RUN --keys ...`)."""

from __future__ import annotations

import difflib
import fnmatch
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapo_mcore.utils.errors import ConfigError
from dapo_mcore.utils.metrics_log import read_metrics

_MAX_COLUMNS = 4


@dataclass(frozen=True)
class Panel:
    title: str
    left: tuple[str, ...]  # metric keys or globs, on the left y axis
    right: tuple[str, ...] = ()  # another unit: on a second y axis, dashed
    log_scale: bool = False  # values spanning decades (1e-14 .. 1e-2); used only when all are positive


DEFAULT_PANELS = (
    # held-out avg@k (eval/<file>/avg@k) beside the rollout accuracy: the same quantity on unseen prompts
    Panel("accuracy and reward", ("rollout/accuracy", "rollout/reward_mean", "eval/*/avg@*")),
    Panel("response length (tokens) / truncated share", ("rollout/response_len_mean",), ("rollout/truncated_frac",)),
    Panel("entropy (nats per token)", ("actor/entropy",)),
    Panel("clip fractions", ("actor/clip_frac_low", "actor/clip_frac_high", "actor/dual_clip_frac")),
    Panel("policy loss / grad norm", ("loss/policy",), ("actor/grad_norm",)),
    Panel("kept groups / generation rounds", ("dynamic_sampling/kept_groups",), ("dynamic_sampling/rounds",)),
    Panel(
        "mismatch, engine vs actor",
        ("mismatch/abs_logp_diff_max", "mismatch/abs_logp_diff_mean", "mismatch/k3_kl"),
        log_scale=True,
    ),
    Panel("time per phase (s)", ("time/step_s", "time/*_s")),  # the whole step first, then its phases
)


def plot_run(metrics_path: Path, png_path: Path, title: str = "", keys: Sequence[str] | None = None) -> list[Panel]:
    """Draw the default grid (keys None: panels whose metrics the run lacks are left out) or one panel per
    key or glob of `keys` into png_path; returns the panels drawn, with the metric keys each one shows."""
    rows = read_metrics(metrics_path)
    present = sorted({key for row in rows for key in row if key != "step"})
    if keys is None:
        panels = [p for p in (_resolve(panel, present) for panel in DEFAULT_PANELS) if p.left or p.right]
    else:
        panels = [Panel(key, tuple(_matching(key, present, metrics_path)), log_scale=False) for key in keys]
    if panels:  # a run stopped before its first step has no rows: nothing to draw yet
        _draw(panels, rows, Path(png_path), title)
    return panels


def _resolve(panel: Panel, present: list[str]) -> Panel:
    left = dict.fromkeys(key for pattern in panel.left for key in fnmatch.filter(present, pattern))
    right = dict.fromkeys(key for pattern in panel.right for key in fnmatch.filter(present, pattern))
    return Panel(panel.title, tuple(left), tuple(right), panel.log_scale)


def _matching(pattern: str, present: list[str], metrics_path: Path) -> list[str]:
    found = fnmatch.filter(present, pattern)
    if found:
        return found
    close = difflib.get_close_matches(pattern, present, n=3, cutoff=0.6)
    families = sorted({key.split("/")[0] + "/*" for key in present if "/" in key})
    hint = f"close: {', '.join(close)}" if close else f"its metrics: {', '.join(families)}"
    raise ConfigError(f"plot: no metric {pattern!r} in {metrics_path} ({hint})")


def _draw(panels: list[Panel], rows: list[dict[str, Any]], png_path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = min(_MAX_COLUMNS, len(panels))
    grid_rows = math.ceil(len(panels) / columns)
    width, height = 4.4 * columns, 3.3 * grid_rows + 0.3
    fig, axes = plt.subplots(grid_rows, columns, figsize=(width, height), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        _draw_panel(ax, panel, rows)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=12)
    # fixed margins in inches, room for both y axes' labels: tight_layout measured every label and took
    # half of the drawing time, which the trainer pays every logging.plot_interval steps
    fig.subplots_adjust(
        left=0.6 / width, right=1 - 0.6 / width, bottom=0.5 / height, top=1 - 0.7 / height, wspace=0.4, hspace=0.5
    )
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def _draw_panel(ax, panel: Panel, rows: list[dict[str, Any]]) -> None:
    from matplotlib.ticker import MaxNLocator

    lines = _draw_lines(ax, panel.left, rows, color_from=0, dashed=False)
    top = ax
    if panel.right:
        top = ax.twinx()
        lines += _draw_lines(top, panel.right, rows, color_from=len(panel.left), dashed=True)
        top.tick_params(labelsize=8)
    values = [y for line in lines for y in line.get_ydata()]
    if panel.log_scale and values and min(values) > 0:
        ax.set_yscale("log")
    if len(lines) > 1:  # on the top axes, so that no line of the twin axis is drawn over it
        top.legend(lines, [line.get_label() for line in lines], fontsize=7, loc="best", framealpha=0.85)
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step (updates done)", fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)


def _draw_lines(ax, keys: Sequence[str], rows: list[dict[str, Any]], color_from: int, dashed: bool) -> list:
    lines = []
    for index, key in enumerate(keys):
        points = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
        if not points:
            continue
        label = _label(key) + (" (right axis)" if dashed else "")
        style = "--" if dashed else "-"
        marker = "o" if key.startswith("eval/") or len(points) < 30 else None
        (line,) = ax.plot(
            *zip(*points), style, marker=marker, markersize=3, color=f"C{color_from + index}", label=label
        )
        lines.append(line)
    return lines


def _label(key: str) -> str:
    """Legend text: 'eval/heldout/avg@4' -> 'held-out heldout avg@4', 'rollout/accuracy' -> 'accuracy'."""
    parts = key.split("/")
    if parts[0] == "eval" and len(parts) == 3:
        return f"held-out {parts[1]} {parts[2]}"
    return parts[-1]
