"""Per-step metrics: one JSON object per line in metrics.jsonl, mirrored to wandb (offline by default)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dapo_mcore.utils.logging import get_logger

log = get_logger(__name__)


class MetricsWriter:
    def __init__(
        self,
        run_dir: Path,
        wandb_mode: str = "disabled",
        project: str = "",
        run_name: str = "",
        config: dict[str, Any] | None = None,
        run_id: str | None = None,
    ):
        self.path = Path(run_dir) / "metrics.jsonl"
        self._wandb_run = None
        self._pending_tables: dict[str, Any] = {}  # log_table's, sent with the next metrics row
        if wandb_mode != "disabled":
            self._wandb_run = _start_wandb(Path(run_dir), wandb_mode, project, run_name, config, run_id)

    @property
    def wandb_run_id(self) -> str | None:
        return None if self._wandb_run is None else self._wandb_run.id

    def write(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        if self._wandb_run is not None:
            tables, self._pending_tables = self._pending_tables, {}
            self._wandb_run.log({**row, **tables}, step=step)

    def log_table(self, step: int, rows: list[dict[str, Any]], key: str = "samples") -> None:
        """rows (dicts with the same keys) as a wandb table, sent with the next metrics row (the step's, written
        after its rollout): wandb drops data logged to a step below its newest, so the step's data goes in
        one call. Values other than numbers, strings and booleans are shown as JSON."""
        if self._wandb_run is None or not rows:
            return
        import wandb

        columns = list({"step": step, **rows[0]})
        data = [[_cell({"step": step, **row}.get(column)) for column in columns] for row in rows]
        self._pending_tables[key] = wandb.Table(columns=columns, data=data)

    def close(self) -> None:
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with Path(path).open() as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _cell(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else json.dumps(value)


def _plain(value: Any) -> Any:
    value = float(value) if not isinstance(value, (int, str)) else value
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _start_wandb(run_dir: Path, mode: str, project: str, name: str, config: dict[str, Any] | None, run_id: str | None):
    import wandb  # lazy: importing wandb costs seconds

    return wandb.init(
        project=project,
        name=name,
        dir=str(run_dir),
        mode=mode,
        config=config,
        id=run_id,
        resume="allow" if run_id else None,
        settings=wandb.Settings(silent=True, console="off"),
    )


def roll_back_metrics(path: Path, first_step: int) -> int:
    """Keep the rows of steps before `first_step` in `path`; append the others (steps a resumed run runs
    again) to metrics.rolled_back.jsonl next to it. Returns how many rows were moved. Nothing is deleted."""
    path = Path(path)
    if not path.exists():
        return 0
    kept, moved = [], []
    for line in (line for line in path.read_text().splitlines() if line.strip()):
        (kept if _step_of(line) < first_step else moved).append(line)
    if moved:
        with path.with_name("metrics.rolled_back.jsonl").open("a") as fh:
            fh.write("\n".join(moved) + "\n")
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(path)
    return len(moved)


def _step_of(line: str) -> float:
    """A row's step; a row cut short by a killed process counts as after every step (it is moved)."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return math.inf
