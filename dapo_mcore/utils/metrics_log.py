"""Per-step metrics: one JSON object per line in metrics.jsonl, mirrored to wandb (offline by default)."""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dapo_mcore.utils.errors import RunFilesError, os_reason
from dapo_mcore.utils.logging import get_logger

log = get_logger(__name__)


@dataclass
class WandbOptions:
    """What wandb.init is given besides the run's name, config and id (the config's logging.wandb section)."""

    mode: str = "disabled"  # offline, online or disabled
    project: str = ""
    entity: str = ""  # empty: the login's default
    group: str = ""
    tags: list[str] = field(default_factory=list)
    # wandb's informational lines (its banner, a Weave advertisement when vLLM has imported openai) off;
    # its warnings and errors still show (logging.engine_log=quiet)
    quiet: bool = True


class MetricsWriter:
    def __init__(
        self,
        run_dir: Path,
        wandb_options: WandbOptions | None = None,
        run_name: str = "",
        config: dict[str, Any] | None = None,
        run_id: str | None = None,
    ):
        self.path = Path(run_dir) / "metrics.jsonl"
        self._wandb_run = None
        self._pending_tables: dict[str, Any] = {}  # log_table's, sent with the next metrics row
        if wandb_options is not None and wandb_options.mode != "disabled":
            self._wandb_run = _start_wandb(Path(run_dir), wandb_options, run_name, config, run_id)
        # kept when wandb's service is lost mid-run: the stop's save records it, and the re-queued job continues
        # the same wandb run instead of starting another
        self._run_id = None if self._wandb_run is None else self._wandb_run.id

    @property
    def wandb_run_id(self) -> str | None:
        return self._run_id

    def write(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in sorted(metrics.items())}}
        try:
            with self.path.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
        except OSError as err:  # a read-only or full file system, a quota, no permission: the run's record is lost
            raise RunFilesError(
                f"cannot write the metrics of step {step} to {self.path} ({os_reason(err)}); the rows before it "
                "are kept, and so is every complete save: make room (or fix the mount), then run the same "
                "command again with checkpoint.resume=auto"
            ) from None
        if self._wandb_run is not None:
            tables, self._pending_tables = self._pending_tables, {}
            try:
                self._wandb_run.log({**row, **tables}, step=step)
            except ConnectionError as err:
                self._lose_wandb(step, err)

    def _lose_wandb(self, step: int, err: ConnectionError) -> None:
        """wandb's service process is gone: Slurm signals every process of the job (scancel, preemption, the time
        limit), wandb's too, while the run still finishes its step and saves. metrics.jsonl goes on."""
        import wandb

        log.warning("wandb's service process has ended (%s): step %d on goes to metrics.jsonl only", err, step)
        self._wandb_run = None
        with contextlib.suppress(ConnectionError):
            wandb.teardown()  # unregisters wandb's exit hook, which would fail the same way

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
            run, self._wandb_run = self._wandb_run, None
            _finish_wandb(run)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl; a row cut short (a killed run's last) is left out, as roll_back_metrics does,
    and so is a line that is JSON but not a row (an object), with one warning naming it."""
    rows = []
    with Path(path).open() as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            with contextlib.suppress(json.JSONDecodeError):
                row = json.loads(line)
                if isinstance(row, dict):
                    rows.append(row)
                else:
                    log.warning("%s line %d is not a metrics row (a JSON object): %.60s; left out", path, number,
                                line.strip())  # fmt: skip
    return rows


def _cell(value: Any) -> Any:
    return value if value is None or isinstance(value, (bool, int, float, str)) else json.dumps(value)


def _plain(value: Any) -> Any:
    value = float(value) if not isinstance(value, (int, str)) else value
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _start_wandb(run_dir: Path, options: WandbOptions, name: str, config: dict[str, Any] | None, run_id: str | None):
    import wandb  # lazy: importing wandb costs seconds

    if options.quiet:  # wandb's terminal lines follow its process-wide settings, not the run's
        wandb.setup(settings=wandb.Settings(show_info=False))
    return wandb.init(
        project=options.project,
        entity=options.entity or None,
        group=options.group or None,
        tags=options.tags or None,
        name=name,
        dir=str(run_dir),
        mode=options.mode,
        config=config,
        id=run_id,
        resume="allow" if run_id else None,
        settings=wandb.Settings(silent=options.quiet, console="off"),
    )


def _finish_wandb(run) -> None:
    """Finish the run and end wandb's service process now, not in wandb's exit hook: after a Ctrl-C or SIGTERM
    the CLI ends the processes the run left (cli.py), the service among them, and the hook would then write
    to its closed socket ("Exception ignored in atexit callback ... ConnectionResetError", a traceback after
    the stop line). A service killed already (Slurm signals every process of the job) lost what it had not
    written; the offline run keeps what it had."""
    import wandb

    try:
        run.finish()
    except ConnectionError as err:
        log.warning("wandb's service process ended before the run closed (%s); wandb keeps what it had written", err)
    with contextlib.suppress(ConnectionError):  # a service gone: nothing left to wait for
        wandb.teardown()  # unregisters the exit hook first, then waits for the service to end


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
