"""`dapo-mcore rehearse RECIPE`: the recipe's step at its real counts through the real loop on the CPU, with what
each rank holds, sends and receives measured phase by phase (docs/rehearsal.md).

The parent process makes the shrunk model and the rehearsal's overrides (setup.py), then for each world size N
launches `dapo-mcore rehearse-rank` on N gloo processes through torchrun: each is a plain `train` of the
rehearsal config with a RankProbe observing its phases (probes.py). A second launch resumes the save the first
made. The records of every rank are then read into the report (report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dapo_mcore.config import load_config, validate
from dapo_mcore.plan import plan_memory, read_model_config
from dapo_mcore.rehearse.report import Rehearsal, RehearsalFailed, World, write_report
from dapo_mcore.rehearse.setup import (
    RecipeShape,
    default_load,
    full_counts,
    per_rank_counts,
    rehearsal_overrides,
    shrink_model,
    threads_per_process,
)
from dapo_mcore.utils.errors import ConfigError


def rehearse_command(args: argparse.Namespace) -> int:
    if args.report_only:  # the runs of an earlier rehearsal into that directory, judged again
        args = _saved_args(args.out)
    if not args.recipe:
        raise ConfigError("rehearse: name the recipe (examples/*.yaml), or --report-only --out DIR")
    cfg = load_config(args.recipe, args.overrides)  # checked as the rehearsal's config below (its model is not here)
    hf = read_model_config(args.model_config, cfg.model.hf_path)
    shape = RecipeShape.of(cfg, args.gpus)
    per_rank = args.mode == "per-rank"
    load = (args.load or default_load(shape, args.mean_len)) if per_rank else 1.0
    out = Path(args.out or f"runs/rehearsal/{cfg.name}-{args.mode}-{args.mean_len:g}")
    positions = (cfg.data.max_prompt_len or 512) + cfg.rollout.sampling.max_response_len  # 0: prompts unlimited
    model_dir = shrink_model(hf, out / "model", positions)
    steps = args.steps or (2 if per_rank else 1)
    rehearsal = Rehearsal(args.recipe, cfg.name, args.mode, shape, args.mean_len, load, steps, args.micro_batches,
                          plan_memory(cfg, hf, args.gpu_gb, args.gpus), not args.no_save)  # fmt: skip
    print(rehearsal.header(), flush=True)
    if not args.report_only:
        out.mkdir(parents=True, exist_ok=True)
        (out / "args.json").write_text(json.dumps({k: v for k, v in vars(args).items() if k != "func"}, indent=1))
    for world in args.world_size or ([2, 4, 8] if per_rank else [2]):
        counts = per_rank_counts(shape, world, load) if per_rank else full_counts(shape, world)
        run_dir = out / f"N{world}"
        # the user's overrides describe the recipe (its counts are the shape above); the rehearsal's come last
        ep, engine_tp, cp = shape.expert_parallel_at(world), shape.engine_tp_at(world), shape.context_parallel_at(world)
        rehearsal_part = rehearsal_overrides(
            counts, model_dir, run_dir, args.mean_len, steps, args.micro_batches, not args.no_save, ep, engine_tp, cp
        )
        overrides = [*args.overrides, *rehearsal_part]
        if not args.report_only:
            validate(load_config(args.recipe, overrides))  # a bad override in one line, before any process starts
            run_world(args, overrides, world, run_dir)
        seconds = float((run_dir / "wall_s").read_text())
        rehearsal.worlds.append(World.read(world, counts, run_dir / "records", run_dir, seconds))
        print(rehearsal.worlds[-1].summary_line(), flush=True)
    print(write_report(rehearsal, out))
    print(f"report: {out / 'report.md'} (and report.json)")
    return 0


def _saved_args(out: str | None) -> argparse.Namespace:
    """The arguments an earlier rehearsal into `out` ran with (its args.json)."""
    if not out or not (Path(out) / "args.json").is_file():
        raise ConfigError("--report-only needs --out DIR of an earlier rehearsal (its args.json)")
    saved = json.loads((Path(out) / "args.json").read_text())
    return argparse.Namespace(**{**saved, "out": out, "report_only": True})


def run_world(args: argparse.Namespace, overrides: list[str], world: int, run_dir: Path) -> None:
    """The rehearsal's launches on `world` processes: the run, then (with a save) its resume. Records and logs
    go to run_dir; its wall time (the run's) to run_dir/wall_s."""
    if run_dir.exists():  # an earlier rehearsal's run: train would move it aside under the rehearsal's open log
        aside = run_dir.with_name(f"{run_dir.name}.prev-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(aside)
        print(f"moved the earlier rehearsal's {run_dir} to {aside}", flush=True)
    records = run_dir / "records"
    records.mkdir(parents=True)
    seconds = launch(args.recipe, overrides, records / "train", world, run_dir / "train.log")
    if not args.no_save:
        resume = [*overrides, "checkpoint.resume=auto"]
        launch(args.recipe, resume, records / "resume", world, run_dir / "resume.log")
    (run_dir / "wall_s").write_text(f"{seconds:.1f}\n")


def launch(recipe: str, overrides: list[str], records: Path, world: int, log: Path) -> float:
    """One `rehearse-rank` run on `world` gloo processes; its output to `log`. Returns its wall seconds."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"]
    cmd += ["-m", "dapo_mcore.cli", "rehearse-rank", "--records", str(records), recipe, *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads_per_process(world, os.cpu_count() or 1))}
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise RehearsalFailed(f"the rehearsal on {world} processes failed (exit {proc.returncode}); {log}:\n{tail}")
    return seconds


def rank_command(args: argparse.Namespace) -> int:
    """`dapo-mcore rehearse-rank --records PREFIX RECIPE overrides` (launched by rehearse under torchrun): a
    plain train of the config, its phases observed. The collectives are counted from before Megatron-Core's
    import (it keeps references to some of them)."""
    from dapo_mcore.rehearse.probes import ByteCounter, RankProbe

    counter = ByteCounter().install()
    probe = RankProbe(Path(f"{args.records}-rank{os.environ.get('RANK', '0')}.jsonl"), counter)
    from dapo_mcore.config.validate import run_dir_of
    from dapo_mcore.trainer import train
    from dapo_mcore.utils.processes import run_tmp
    from dapo_mcore.utils.timers import observing

    cfg = load_config(args.recipe, args.overrides)
    try:
        with run_tmp(str(run_dir_of(cfg)), int(os.environ.get("RANK", "0"))), observing(probe):
            train(cfg)
    finally:
        probe.finish()
    return 0
