"""The rehearsal's report: per phase and per rank what was measured (probes.py), how each per-rank figure grows
with the number of ranks when each rank's own share is held (per-rank mode), what holds more than a rank's
share of the step (full-count mode), and the memory planner's per-GPU figures at the real shape beside them.

A per-rank figure should follow the rank's own share of the step: at a held share it stays flat as ranks are
added. One that grows is named, with its fitted growth per rank and its value projected to the recipe's world.
Full-count mode names the Python containers with an entry per token of a rank's share and lists the largest
tensors at the real count, in bytes per token of the share.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dapo_mcore.plan import MemoryPlan
from dapo_mcore.rehearse.probes import TOP
from dapo_mcore.rehearse.setup import HIDDEN, LAYERS, Counts, RecipeShape
from dapo_mcore.utils.errors import DapoError

PHASES = (
    *("step", "generate", "reward", "summaries", "exchange", "old_logprobs", "update", "weight_push"),
    *("save", "restore"),
)
MB = 2**20
# (key, label, how instances of a phase within a step combine, floor: a rise from the fewest ranks to the most
# below it is noise). The floors are absolute: a rank's figures start from the same baseline at every N (the
# imports' half a million objects, 0.5-1 GB of RSS), so a share of it would hide what grows.
QUANTITIES = (
    ("peak_rss_mb", "peak RSS MB", "max", 64.0),
    ("sent_mb", "sent MB", "sum", 0.0625),
    ("received_mb", "received MB", "sum", 0.0625),
    ("objects", "live objects", "max", 10_000.0),
    ("tensor_mb", "live tensors MB", "max", 16.0),
    ("largest_tensor_mb", "largest tensor MB", "max", 16.0),
    ("longest_container", "longest container", "max", 2000.0),
    ("workspace_mb", "attention workspace MB", "max", None),  # the CPU's local layers only (probes.py)
    ("seconds", "seconds", "sum", None),  # shown, never judged: 2 cores shared by N processes
)
GROWTH_TOLERANCE = 0.1  # and at least this share of the value at the fewest ranks (a bytes figure near zero)
# The bytes of the phase that moves the step's kept samples follow the rank's share of the kept answer tokens,
# which is drawn (lognormal lengths, which groups dynamic sampling keeps): at a few prompts a rank, the share
# itself varies by 20% between runs. Judged per kept token (scaled to the fewest ranks' share), where the runs
# recorded rollout/trained_answer_tokens.
PER_KEPT_TOKEN = {("exchange", "sent_mb"), ("exchange", "received_mb")}


class RehearsalFailed(DapoError):
    """A rehearsal's run failed, or trained to a non-finite loss or gradient norm: what it met is the finding (its
    log names the phase and the cause)."""

    exit_code = 1


# What a step that updated the actor must have finite (metrics.jsonl writes NaN and inf as null).
FINITE_METRICS = ("loss/policy", "actor/grad_norm")


def refuse_non_finite(metrics: list[dict[str, Any]], n: int, run_dir: Path) -> None:
    """Stop the rehearsal with one line at the first step (of N=n's runs, in run_dir) whose loss or gradient norm
    is not finite. A step without an update (every group filtered out) has no gradient norm to judge."""
    for row in metrics:
        if row.get("actor/updates", 1) == 0:
            continue
        bad = [key for key in FINITE_METRICS if key in row and not _finite(row[key])]
        if bad:
            figures = ", ".join(f"{key} {_shown(row[key])}" for key in FINITE_METRICS if key in row)
            raise RehearsalFailed(
                f"the rehearsal on {n} processes trained to a non-finite {' and '.join(bad)} at step "
                f"{row.get('step')} ({figures}): stopped there; its logs and metrics.jsonl are in {run_dir}"
            )


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def _shown(value: Any) -> str:
    return f"{value:.6g}" if _finite(value) else "NaN or inf"


def _figures(record: dict[str, Any]) -> dict[str, float]:
    return {
        "peak_rss_mb": record["peak_rss_mb"],
        "sent_mb": record["sent_bytes"] / MB,
        "received_mb": record["received_bytes"] / MB,
        "objects": record.get("objects", 0),
        "tensor_mb": record.get("tensor_bytes", 0) / MB,
        "largest_tensor_mb": max((t["bytes"] for t in record.get("largest_tensors", [])), default=0) / MB,
        "longest_container": max((c["len"] for c in record.get("longest_containers", [])), default=0),
        "workspace_mb": record.get("workspace_bytes", 0) / MB,
        "seconds": record["seconds"],
    }


@dataclass
class PhaseFigures:
    """One phase on one world: each quantity's worst rank, and what holds the largest tensor / container."""

    values: dict[str, float] = field(default_factory=dict)  # the worst rank's
    mean: dict[str, float] = field(default_factory=dict)  # the ranks' mean: what growth is judged on
    largest_tensors: list[dict[str, Any]] = field(default_factory=list)  # the worst ranks' top objects
    longest_containers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def largest_tensor(self) -> dict[str, Any]:
        return self.largest_tensors[0] if self.largest_tensors else {}


@dataclass
class World:
    """The records of one world size's two launches (train, then the resume)."""

    n: int
    counts: Counts
    seconds: float
    exits: list[dict[str, Any]]
    processes: list[dict[str, Any]]
    metrics: list[dict[str, Any]]

    @classmethod
    def read(cls, n: int, counts: Counts, records: Path, run_dir: Path, seconds: float) -> World:
        exits, processes = [], []
        for path in sorted(records.glob("*.jsonl")):
            for line in path.read_text().splitlines():
                record = json.loads(line)
                if record.get("event") == "exit":
                    exits.append(record)
                elif record.get("event") == "process":
                    processes.append(record)
        metrics_path = run_dir / "metrics.jsonl"
        metrics = [json.loads(line) for line in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
        metrics = [m for m in metrics if m.get("step", 0) > 0]
        refuse_non_finite(metrics, n, run_dir)
        return cls(n, counts, seconds, exits, processes, metrics)

    def steps(self) -> list[int]:
        return sorted({r["step"] for r in self.exits if r["phase"] == "step"})

    def phases(self, step: int | None = None) -> dict[str, PhaseFigures]:
        """Per phase: per (rank, step) the instances combined (sum of bytes and seconds, max of the rest), then
        the worst (rank, step); of one step only where given (with the save after it and the restore)."""
        per_key: dict[tuple[str, int, int], dict[str, float]] = {}
        out: dict[str, PhaseFigures] = {}
        for record in self.exits:
            if step is not None and record["step"] != step and record["phase"] != "restore":
                continue
            key = (record["phase"], record["rank"], record["step"] if record["phase"] != "restore" else -1)
            combined = per_key.setdefault(key, {})
            for name, value in _figures(record).items():
                how = next(q[2] for q in QUANTITIES if q[0] == name)
                combined[name] = combined.get(name, 0.0) + value if how == "sum" else max(combined.get(name, 0), value)
            figures = out.setdefault(record["phase"], PhaseFigures())
            _keep_largest(figures, record)
        per_rank: dict[tuple[str, int], dict[str, float]] = {}  # (phase, rank): its worst step
        for (phase, rank, _), combined in per_key.items():
            worst = per_rank.setdefault((phase, rank), {})
            for name, value in combined.items():
                worst[name] = max(worst.get(name, 0.0), value)
        for (phase, _), worst in per_rank.items():
            figures = out[phase]
            ranks = sum(1 for p, _ in per_rank if p == phase)
            for name, value in worst.items():
                figures.values[name] = max(figures.values.get(name, 0.0), value)
                figures.mean[name] = figures.mean.get(name, 0.0) + value / ranks
        return out

    def tokens_per_step(self) -> float:
        """The step's trained answer tokens (all ranks), from the run's metrics."""
        rows = [m for m in self.metrics if "rollout/response_len_mean" in m]
        if not rows:
            return 0.0
        answers = self.counts.prompts_per_step * _answers_per_prompt(rows[-1])
        return max(m["rollout/response_len_mean"] for m in rows) * answers

    def kept_tokens_per_rank(self, step: int | None = None) -> float:
        """The rank's share of the step's trained answer tokens (the worst step's, or `step`'s); 0 if unrecorded."""
        rows = [m for m in self.metrics if "rollout/trained_answer_tokens" in m and step in (None, m["step"])]
        return max((m["rollout/trained_answer_tokens"] for m in rows), default=0.0) / self.n

    def summary_line(self) -> str:
        peak = max((p["peak_rss_mb"] for p in self.processes), default=0.0)
        return (
            f"N={self.n}: {self.counts.prompts_per_step} prompts a step, {self.counts.prompts_per_round} a round: "
            f"done in {self.seconds:.0f} s, peak RSS of a rank {peak:.0f} MB"
        )


def _answers_per_prompt(row: dict[str, Any]) -> int:
    return int(row.get("rollout/answers_per_prompt", 0)) or 16


def _keep_largest(figures: PhaseFigures, record: dict[str, Any]) -> None:
    """The TOP largest tensors and longest containers of the phase over its ranks and instances (one entry per
    holder: the same buffer on every rank is named once, at its largest)."""
    for found, key, size in (
        (figures.largest_tensors, "largest_tensors", "bytes"),
        (figures.longest_containers, "longest_containers", "len"),
    ):
        for item in record.get(key, []):
            same = next((f for f in found if f["held_by"] == item["held_by"]), None)
            if same is None or item[size] > same[size]:
                if same is not None:
                    found.remove(same)
                found.append({**item, "rank": record["rank"]})
        found.sort(key=lambda f: -f[size])
        del found[TOP:]


@dataclass
class Growth:
    """A per-rank quantity across world sizes: values, least-squares growth per rank, projection."""

    phase: str
    quantity: str
    worlds: list[int]
    values: list[float]
    slope: float
    projected: float
    grows: bool


def fit(worlds: list[int], values: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (world, value)."""
    n = len(worlds)
    mean_w, mean_v = sum(worlds) / n, sum(values) / n
    var = sum((w - mean_w) ** 2 for w in worlds)
    slope = sum((w - mean_w) * (v - mean_v) for w, v in zip(worlds, values)) / var if var else 0.0
    return mean_v - slope * mean_w, slope


def growth_table(worlds: list[World], project_to: int, step: int | None = None) -> list[Growth]:
    """Every (phase, quantity) measured at each world size (at its worst step, or at `step`); `grows` where the
    value rises by more than its quantity's floor and GROWTH_TOLERANCE of itself from the fewest ranks to the
    most."""
    if len(worlds) < 2:
        return []
    by_world = [w.phases(step) for w in worlds]
    sizes = [w.n for w in worlds]
    shares = [w.kept_tokens_per_rank(step) for w in worlds]
    out = []
    for phase in PHASES:
        if not all(phase in figures for figures in by_world):
            continue
        for key, label, _, floor in QUANTITIES:
            values = [figures[phase].mean.get(key, 0.0) for figures in by_world]
            if (phase, key) in PER_KEPT_TOKEN and all(shares):
                values = [v * shares[0] / share for v, share in zip(values, shares)]
                label += f" per kept token (x N={sizes[0]}'s share)"
            intercept, slope = fit(sizes, values)
            rise = values[-1] - values[0]
            grows = floor is not None and rise > floor and rise > GROWTH_TOLERANCE * values[0]
            out.append(Growth(phase, label, sizes, values, slope, intercept + slope * project_to, grows))
    return out


def per_token_containers(world: World) -> list[str]:
    """Full-count mode: Python containers with more entries than half this rank's share of the step's tokens (a
    list of numbers costs about 70 bytes a token: 4.7 GB at an 8k mean), named with what holds them."""
    share = world.tokens_per_step() / world.n
    found: dict[str, str] = {}
    for phase, figures in world.phases().items():
        for c in figures.longest_containers:
            if share > 0 and c["len"] > 0.5 * share and c["held_by"] not in found:
                holder = _holder(c["held_by"])
                found[c["held_by"]] = (
                    f"{phase}: a {c['type']} of {c['len']:,} entries held by {holder} (rank {c['rank']}): an entry "
                    f"for each of the rank's {share:,.0f} tokens or more"
                )
    return list(found.values())


def _holder(held_by: str) -> str:
    """The census's '?' (probes.held_by): nothing nameable holds it, as a function's local variable."""
    return "a local variable" if held_by == "?" else held_by


def largest_objects(world: World) -> list[str]:
    """Full-count mode: the largest tensors of the step's phases, in bytes per token of the rank's share (what
    they become at other lengths and counts), each once (its largest) with what holds it. Whether one follows
    the rank's share or the step's global count is per-rank mode's judgement; here its size at the real count."""
    share = world.tokens_per_step() / world.n
    seen: dict[str, tuple[float, str]] = {}
    for phase, figures in world.phases().items():
        for t in figures.largest_tensors:
            size = t["bytes"]
            if size > seen.get(t["held_by"], (0.0, ""))[0]:
                per_token = f", {size / share:.1f} B a token of the rank's share" if share else ""
                shape = ", ".join(map(str, t["shape"]))
                seen[t["held_by"]] = (
                    size,
                    f"{_holder(t['held_by'])}: [{shape}] {t['dtype']}, {size / MB:,.0f} MB in {phase}{per_token}",
                )
    return [line for _, line in sorted(seen.values(), reverse=True)[:8]]


@dataclass
class Rehearsal:
    recipe: str
    name: str
    mode: str
    shape: RecipeShape
    mean_len: float
    load: float
    steps: int
    micro_batches: int
    plan: MemoryPlan
    saves: bool = True
    worlds: list[World] = field(default_factory=list)
    started: float = field(default_factory=time.time)

    def header(self) -> str:
        s, when = self.shape, time.strftime("%Y-%m-%d %H:%M", time.localtime(self.started))
        lines = [
            f"# Rehearsal of {self.recipe} ({self.mode}), {when}",
            "",
            f"- machine: {platform.machine()}, {os.cpu_count()} cores, {_host_memory_gib():.0f} GiB",
            f"- the recipe's step: {s.prompts_per_step} prompts x {s.answers_per_prompt} answers, rounds of "
            f"{s.prompts_per_round} prompts, {s.updates_per_step} updates; mean answer {self.mean_len:g} tokens "
            f"(lognormal, cut at {s.max_response_len}); on {s.gpus} GPUs: actor DP {s.dp}, {s.replicas} engine "
            "replicas",
            f"- model: the recipe's vocabulary, experts and top-k; hidden {HIDDEN}, {LAYERS} layers "
            "(rehearse/setup.py)",
            f"- each process: one actor DP rank and {_engine_share(s.engine_tp)} of the synthetic engine, "
            f"{self.steps} step(s)" + (", a save and its resume (a second launch)" if self.saves else ", no save"),
        ]
        if s.context_parallel > 1:
            lines.append(
                f"- context parallelism: the recipe's CP {s.context_parallel}, rehearsed at CP 2 where N is even "
                "(a pair of processes is one actor DP rank; its K/V all-gathers are in the phases' bytes)"
            )
        if s.expert_parallel > 1:
            lines.append(
                f"- experts: the recipe's EP {s.expert_parallel}, rehearsed at the largest EP that divides it and N "
                "(at N=2: EP 2), with the recipe's micro-batches"
            )
        if self.mode == "per-rank":
            lines.append(f"- per-rank load: {self.load:.3g} x one recipe rank's share (the same at every N)")
        if self.micro_batches:
            lines.append(
                f"- the actor computes {self.micro_batches} micro-batch(es) a step (trainer.rehearsal_micro_batches); "
                "every other one is built and held as in training"
            )
        return "\n".join(lines)


def _engine_share(engine_tp: int) -> str:
    if engine_tp == 1:
        return "one replica"
    return (
        f"one TP rank of a replica (the recipe's engine TP {engine_tp}, rehearsed at the largest that divides it and "
        "N: its ranks generate alike, agree on verdicts and stop together)"
    )


def _host_memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        return 0.0


def _format_phase_table(world: World) -> list[str]:
    figures = world.phases()
    head = "| phase | " + " | ".join(label for _, label, _, _ in QUANTITIES) + " | largest tensor (held by) |"
    lines = [head, "|" + "---|" * (len(QUANTITIES) + 2)]
    for phase in PHASES:
        if phase not in figures:
            continue
        f = figures[phase]
        cells = [_cell(f.values.get(key, 0.0)) for key, _, _, _ in QUANTITIES]
        tensor = f.largest_tensor
        held = f"{tensor.get('shape')} {tensor.get('dtype')} ({_holder(tensor.get('held_by', '?'))})" if tensor else ""
        lines.append(f"| {phase} | " + " | ".join(cells) + f" | {held} |")
    return lines


def _cell(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.2f}"


def format_report(rehearsal: Rehearsal) -> str:
    lines = [rehearsal.header(), ""]
    for world in rehearsal.worlds:
        c = world.counts
        lines += [
            f"## {world.n} processes: {c.prompts_per_step} prompts a step, {c.prompts_per_round} a round, "
            f"{c.mini_batch_size} answers an update ({world.seconds:.0f} s)",
            "",
            "Per phase, the worst rank (bytes and seconds summed over a step's rounds, the rest at their peak):",
            "",
            *_format_phase_table(world),
            "",
        ]
    growth = growth_table(rehearsal.worlds, rehearsal.shape.gpus)
    flagged = [g for g in growth if g.grows]
    if growth:
        sizes = "".join(f" N={n} |" for n in growth[0].worlds)
        lines += [
            f"## Growth with the number of ranks, each rank's share held (the ranks' mean; projected to "
            f"{rehearsal.shape.gpus} ranks)",
            "",
            f"|phase | quantity |{sizes} per added rank | at {rehearsal.shape.gpus} | grows |",
            "|---|---|" + "---|" * (len(growth[0].worlds) + 3),
        ]
        for g in growth:
            cells = " | ".join(_cell(v) for v in g.values)
            lines.append(
                f"| {g.phase} | {g.quantity} | {cells} | {g.slope:+.3g} | {_cell(g.projected)} | "
                f"{'**yes**' if g.grows else ''} |"
            )
        lines.append("")
    found = [f"{g.phase}: {g.quantity} grows with the ranks ({_values(g)})" for g in flagged]
    largest: list[str] = []
    if rehearsal.mode == "full-count":
        for world in rehearsal.worlds:
            found += per_token_containers(world)
            largest += largest_objects(world)
    nothing = "- nothing grows with the global count" if rehearsal.mode == "per-rank" else "- no per-token container"
    lines += ["## Named", ""] + ([f"- {item}" for item in found] or [nothing])
    if largest:
        lines += ["", "## The largest tensors of a rank (the real count)", "", *[f"- {line}" for line in largest]]
    lines += ["", *_plan_lines(rehearsal.plan, rehearsal.shape.gpus)]
    return "\n".join(lines) + "\n"


def _values(g: Growth) -> str:
    return ", ".join(f"{_cell(v)} at N={n}" for n, v in zip(g.worlds, g.values)) + f"; {_cell(g.projected)} projected"


def _plan_lines(plan: MemoryPlan, gpus: int) -> list[str]:
    lines = [
        f"## The planner at the real shape (per GPU, {gpus} GPUs, {plan.layout})",
        "",
        "| phase | GiB |",
        "|---|---|",
    ]
    lines += [f"| {phase.name} | {phase.total / 2**30:.1f} |" for phase in plan.phases]
    return lines


def write_report(rehearsal: Rehearsal, out: Path) -> str:
    text = format_report(rehearsal)
    (out / "report.md").write_text(text)
    growth = growth_table(rehearsal.worlds, rehearsal.shape.gpus)
    data = {
        "recipe": rehearsal.recipe,
        "mode": rehearsal.mode,
        "shape": asdict(rehearsal.shape),
        "mean_len": rehearsal.mean_len,
        "load": rehearsal.load,
        "worlds": [
            {
                "n": w.n,
                "counts": asdict(w.counts),
                "seconds": w.seconds,
                "phases": {k: asdict(v) for k, v in w.phases().items()},
                "processes": w.processes,
            }
            for w in rehearsal.worlds
        ],
        "growth": [asdict(g) for g in growth],
        "growth_by_step": {
            step: [asdict(g) for g in growth_table(rehearsal.worlds, rehearsal.shape.gpus, step)]
            for step in (rehearsal.worlds[0].steps() if rehearsal.worlds else [])
        },
    }
    (out / "report.json").write_text(json.dumps(data, indent=1) + "\n")
    return text
