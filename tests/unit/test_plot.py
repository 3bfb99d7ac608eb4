"""The run's plots: the default grid of curves.png and `dapo-mcore plot` (panels checked by the metric keys
they draw, not by pixels)."""

import json
import math

import pytest

from dapo_mcore.cli import main
from dapo_mcore.utils.plot import plot_run

# one metric of each default panel, as the trainer names them
_STEP_METRICS = {
    "rollout/accuracy": 0.4,
    "rollout/reward_mean": -0.2,
    "rollout/response_len_mean": 20.0,
    "rollout/truncated_frac": 0.1,
    "actor/entropy": 0.12,
    "actor/clip_frac_low": 0.001,
    "actor/clip_frac_high": 0.002,
    "actor/dual_clip_frac": 0.0,
    "loss/policy": 0.1,
    "actor/grad_norm": 0.4,
    "dynamic_sampling/kept_groups": 16.0,
    "dynamic_sampling/rounds": 2.0,
    "mismatch/abs_logp_diff_max": 2e-6,
    "mismatch/k3_kl": 1e-14,
    "time/step_s": 1.2,
    "time/generate_s": 0.8,
    "time/update_s": 0.3,
}
_DEFAULT_TITLES = [
    "accuracy and reward",
    "response length (tokens) / truncated share",
    "entropy (nats per token)",
    "clip fractions",
    "policy loss / grad norm",
    "kept groups / generation rounds",
    "mismatch, engine vs actor",
    "time per phase (s)",
]


def write_metrics(run_dir, steps=6, eval_every=0, leave_out=()):
    """A metrics.jsonl as the step convention writes it: steps 1..N, and with eval a step-0 row holding only
    the held-out result before any update."""
    rows = [{"step": 0, "eval/heldout/avg@4": 0.3}] if eval_every else []
    for step in range(1, steps + 1):
        row = {key: value * (1 + 0.1 * math.sin(step)) for key, value in _STEP_METRICS.items()}
        rows.append({"step": step, **{k: v for k, v in row.items() if not k.startswith(leave_out)}})
        if eval_every and step % eval_every == 0:
            rows[-1]["eval/heldout/avg@4"] = 0.3 + 0.05 * step
    path = run_dir / "metrics.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_default_grid_has_a_panel_for_each_thing_to_watch(tmp_path):
    png = tmp_path / "curves.png"
    panels = plot_run(write_metrics(tmp_path), png, title="demo")
    assert [panel.title for panel in panels] == _DEFAULT_TITLES
    assert png.stat().st_size > 10_000
    by_title = {panel.title: panel for panel in panels}
    assert by_title["policy loss / grad norm"].right == ("actor/grad_norm",)  # its own axis: another unit
    assert by_title["time per phase (s)"].left == ("time/step_s", "time/generate_s", "time/update_s")


def test_default_grid_leaves_out_panels_whose_metrics_the_run_lacks(tmp_path):
    panels = plot_run(write_metrics(tmp_path, leave_out=("mismatch/", "time/")), tmp_path / "curves.png")
    titles = [panel.title for panel in panels]
    assert "mismatch, engine vs actor" not in titles and "time per phase (s)" not in titles
    assert len(titles) == len(_DEFAULT_TITLES) - 2


def test_held_out_avg_at_k_is_on_the_accuracy_panel(tmp_path):
    panels = plot_run(write_metrics(tmp_path, eval_every=3), tmp_path / "curves.png")
    assert panels[0].left == ("rollout/accuracy", "rollout/reward_mean", "eval/heldout/avg@4")


def test_plot_command_draws_one_panel_per_key_or_glob(tmp_path, capsys):
    write_metrics(tmp_path)
    assert main(["plot", str(tmp_path), "--keys", "time/*", "actor/entropy"]) == 0
    assert (tmp_path / "plot.png").stat().st_size > 5_000
    assert "2 panels: time/*; actor/entropy" in capsys.readouterr().out
    panels = plot_run(tmp_path / "metrics.jsonl", tmp_path / "again.png", keys=["time/*", "actor/entropy"])
    assert [panel.left for panel in panels] == [
        ("time/generate_s", "time/step_s", "time/update_s"),
        ("actor/entropy",),
    ]


def test_plot_command_redraws_the_default_grid_of_a_metrics_file(tmp_path, capsys):
    metrics = write_metrics(tmp_path, eval_every=2)
    assert main(["plot", str(metrics), "--out", str(tmp_path / "grid.png")]) == 0
    assert (tmp_path / "grid.png").stat().st_size > 10_000
    assert "8 panels" in capsys.readouterr().out


@pytest.mark.parametrize(
    "key, hint",
    [("actor/entrop", "close: actor/entropy"), ("bogus", "its metrics: actor/*, dynamic_sampling/*, loss/*")],
)
def test_plot_command_unknown_key_is_one_line_naming_close_ones(tmp_path, capsys, key, hint):
    write_metrics(tmp_path)
    assert main(["plot", str(tmp_path), "--keys", key]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"dapo-mcore: error: plot: no metric '{key}'") and hint in err
    assert "\n" not in err


def test_plot_command_skips_a_row_cut_short_and_names_a_missing_out_directory(tmp_path, capsys):
    """A killed run's last row, cut mid-write, and an --out in no directory were tracebacks."""
    metrics = write_metrics(tmp_path)
    with metrics.open("a") as fh:
        fh.write('{"step": 99, "rollout/acc')
    assert main(["plot", str(tmp_path), "--keys", "actor/entropy"]) == 0
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "nowhere" / "x.png")]) == 2
    assert f"plot: --out {tmp_path}/nowhere/x.png: no directory {tmp_path}/nowhere" in capsys.readouterr().err


def test_plot_command_writes_into_an_out_directory_and_leaves_out_a_line_that_is_no_row(tmp_path, capsys):
    """`--out DIR` wrote DIR.png beside the directory; a metrics line that is JSON but not an object was a
    traceback."""
    metrics = write_metrics(tmp_path)
    with metrics.open("a") as fh:
        fh.write("42\n")
    (tmp_path / "figures").mkdir()
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "figures")]) == 0
    assert (tmp_path / "figures" / "curves.png").stat().st_size > 10_000 and not (tmp_path / "figures.png").exists()
    assert main(["plot", str(tmp_path), "--keys", "actor/entropy", "--out", f"{tmp_path / 'more'}/"]) == 2
    assert "no directory" in capsys.readouterr().err  # a directory that is not there is named, not created
