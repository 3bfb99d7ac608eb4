"""`dapo-mcore check`: everything `train` would refuse before its first step, found in one pass on the machine
where the job's files are (a login node: no GPU, no process group, no model built), every problem one line;
then what the run directory will do and the memory plan.

What it covers, in the order `train` meets it: the config's own checks (each section's first problem), the
model's config.json and its architecture, the layout against the model and the job's tasks, the weights and
tokenizer files, a writable checkpoint directory, Transformer Engine where the config needs it, the rollout
engine's package and its support for this model on the job's device, routing replay, every row of the prompt
and held-out files (read by the run's own loaders), the prompts' lengths against the model's positions and
the prompt budget (train's own prompt setup), a live run holding the run directory, the save a resume would
take and every check train makes of it before reading weights, through the same functions (build.resume_from:
the model, its optimizer state at the job's layout, the files of its own its records list; a config that changes
the experiment since it, a data file changed since it, the groups it holds, every replica's file of them), and,
on a GPU job, the per-GPU memory plan (`dapo-mcore plan`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dapo_mcore.build import (
    build_prompt_setup,
    check_routing_replay,
    earlier_saves_problem,
    load_tokenizer,
    no_intact_save_problem,
    resume_from,
)
from dapo_mcore.checkpoint.hf_io import weights_problems
from dapo_mcore.checkpoint.run_checkpoint import (
    find_latest_complete,
    layout_for,
    read_own_file,
    verify_all_but_shards,
)
from dapo_mcore.config import RunConfig
from dapo_mcore.config.model_spec import ModelSpec, load_hf_config, read_model_spec
from dapo_mcore.config.validate import (
    checkpoint_dir_of,
    config_problems,
    config_warnings,
    eval_file_list,
    run_dir_of,
)
from dapo_mcore.data.datasets import PromptStream, build_prompt_source, load_jsonl_prompts
from dapo_mcore.launch import path_problems, tokenizer_problem
from dapo_mcore.mcore.provider import (
    check_model_layout,
    check_moe_training_layout,
    cpu_offload_problem,
    transformer_engine_problem,
)
from dapo_mcore.parallel import check_layout
from dapo_mcore.plan import default_gpus, plan_memory
from dapo_mcore.rewards.pool import resolve_verifier
from dapo_mcore.rollout.model_info import hf_weight_shapes
from dapo_mcore.rollout.pending import check_saved_files
from dapo_mcore.rollout.registry import engine_problem, engine_version
from dapo_mcore.rollout.saved_groups import saved_groups
from dapo_mcore.utils.errors import DapoError
from dapo_mcore.utils.imports import import_callable
from dapo_mcore.utils.logging import quiet_save_reading
from dapo_mcore.utils.run_lock import RunLock


@dataclass
class CheckReport:
    problems: list[str] = field(default_factory=list)
    facts: list[str] = field(default_factory=list)  # what the run reads, where it writes, what it will do

    def attempt(self, check: Callable[[], Any]) -> Any:
        """Run one check; its DapoError becomes a listed problem (the next checks still run). None on failure."""
        try:
            return check()
        except DapoError as err:
            self.problems.append(str(err))
            return None


def check_run(cfg: RunConfig, gpus: int | None, gpu_gb: float) -> CheckReport:
    report = CheckReport(problems=config_problems(cfg))
    report.facts += [f"warning: {line}" for line in config_warnings(cfg)]  # the run logs the same lines
    device = job_device(cfg)
    if cfg.parallel.device == "auto" and device == "cpu":
        report.facts.append("parallel.device=auto is the CPU on this machine (no GPU): add parallel.device=cuda to "
                            "check a GPU job's engine and Transformer Engine")  # fmt: skip
    model_dir = Path(cfg.model.hf_path)
    has_config = bool(cfg.model.hf_path) and (model_dir / "config.json").is_file()  # else the config's checks say
    model_config = report.attempt(lambda: load_hf_config(model_dir)) if has_config else None
    spec = report.attempt(lambda: read_model_spec(model_config)) if model_config is not None else None
    world = job_tasks(cfg, gpus)
    if spec is not None:
        check_model(report, cfg, spec, world)
        report.facts.append(f"layout checked for {world} processes" + ("" if gpus else " (--gpus N for another count)"))
    files = path_problems(cfg.model.hf_path, cfg.model.init, checkpoint_dir_of(cfg))
    files += [p for p in [tokenizer_problem(cfg.model.hf_path)] if p]
    report.problems += [p for p in files if model_dir.is_dir() or not p.startswith("model.hf_path")]
    if model_config is not None and cfg.model.init == "hf" and not files:
        report.problems += report.attempt(lambda: weights_problems(model_dir, hf_weight_shapes(str(model_dir)))) or []
    report.problems += user_function_problems(cfg)
    report.problems += [p for p in [needed_transformer_engine(cfg)] if p]
    if cfg.optimizer.cpu_offload:
        report.problems += [p for p in [cpu_offload_problem(on_cpu=device == "cpu")] if p]
    if model_config is not None:
        report.problems += [p for p in [engine_problem(cfg.rollout.engine, device, model_config)] if p]
    report.facts += [f for f in [engine_version(cfg.rollout.engine)] if f]
    known = len(report.problems)
    check_data(report, cfg, model_read=spec is not None)
    prompts = None
    if spec is not None and not files and len(report.problems) == known:  # rows readable: train's own prompt setup
        prompts = report.attempt(lambda: build_prompt_setup(cfg, load_tokenizer(cfg.model.hf_path), spec))
    if spec is not None:
        report.attempt(lambda: check_run_dir(report, cfg, spec, prompts, world))
    if model_config is not None and device != "cpu":
        report.attempt(lambda: check_memory(report, cfg, model_config, gpu_gb, world))
    return report


def job_device(cfg: RunConfig) -> str:
    """The device the job runs on: parallel.device, or with "auto" this machine's (what train would take here)."""
    if cfg.parallel.device != "auto":
        return cfg.parallel.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def job_tasks(cfg: RunConfig, gpus: int | None) -> int:
    """The job's processes: --gpus, else WORLD_SIZE / SLURM_NTASKS, else one process for a CPU recipe and
    one 8-GPU node for any other (as `dapo-mcore plan`)."""
    if gpus:
        return gpus
    if cfg.parallel.device == "cpu" and not any(os.environ.get(k) for k in ("WORLD_SIZE", "SLURM_NTASKS")):
        return 1
    return default_gpus()


def check_model(report: CheckReport, cfg: RunConfig, spec: ModelSpec, world: int) -> None:
    par = cfg.parallel
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    vpp = par.virtual_pipeline_model_parallel_size
    ep, etp = par.expert_model_parallel_size, par.expert_tensor_parallel_size
    cp = par.context_parallel_size
    if min(tp, pp, vpp, ep, cp) < 1 or etp < 0:
        return  # the config's checks named it
    report.attempt(lambda: check_model_layout(spec, tp, pp, vpp, ep, etp))
    report.attempt(lambda: check_moe_training_layout(spec, tp, par.sequence_parallel))
    report.attempt(lambda: check_routing_replay(cfg, spec))
    report.attempt(lambda: check_layout(world, tp, pp, vpp, ep, etp, cp))


def user_function_problems(cfg: RunConfig) -> list[str]:
    """The verifier and the dynamic-sampling filter the config names, imported as train imports them."""
    problems = []
    by_source = [(f"algorithm.reward.verifiers.{source}", spec, resolve_verifier)
                 for source, spec in cfg.algorithm.reward.verifiers.items()]  # fmt: skip
    for key, spec, load in (
        ("algorithm.reward.verifier", cfg.algorithm.reward.verifier, resolve_verifier),
        *by_source,
        ("algorithm.dynamic_sampling.filter", cfg.algorithm.dynamic_sampling.filter,
         lambda spec: import_callable(spec, "dynamic-sampling filter")),
    ):  # fmt: skip
        try:
            if spec:
                load(spec)
        except DapoError as err:
            problems.append(f"{key}: {err}")
    return problems


def needed_transformer_engine(cfg: RunConfig) -> str | None:
    """Transformer Engine, where the config needs it (transformer_impl=transformer_engine, or FP8)."""
    if cfg.model.transformer_impl != "transformer_engine" and cfg.model.fp8 == "none":
        return None
    problem = transformer_engine_problem()
    if problem is None:
        return None
    asked = f"model.transformer_impl={cfg.model.transformer_impl}" + (
        f" with model.fp8={cfg.model.fp8}" if cfg.model.fp8 != "none" else ""
    )
    return f"{asked} needs Transformer Engine: {problem}"


def check_data(report: CheckReport, cfg: RunConfig, model_read: bool) -> None:
    """Every row of the prompt and held-out files, read by the run's own loaders."""
    data = cfg.data
    reads = [f"model {cfg.model.hf_path}"] if model_read else []
    if data.source == "arithmetic" or Path(data.source).is_file():
        source = report.attempt(
            lambda: build_prompt_source(
                data.source, data.prompt_key, data.answer_key, data.min_operand, data.max_operand, data.ops
            )
        )
        if source is not None:
            reads.append(f"prompts {data.source}" + ("" if data.source == "arithmetic" else f" ({len(source)})"))
    for name in eval_file_list(data.eval_files):
        if Path(name).is_file():
            rows = report.attempt(lambda name=name: load_jsonl_prompts(name, data.prompt_key, data.answer_key))
            if rows is not None:
                reads.append(f"held-out {name} ({len(rows)})")
    if reads:
        report.facts.append("reads " + ", ".join(reads))
    report.facts.append(f"saves to {checkpoint_dir_of(cfg)}")


def check_run_dir(report: CheckReport, cfg: RunConfig, spec: ModelSpec, prompts: Any, world: int) -> None:
    """What `train` will do with the run directory: start, resume at step N, or move an earlier run aside; what
    it refuses there, through train's own code: a live run holding the directory, the save a resume would take
    (found as train finds it, but with the CRC-32 of every file except the weight and optimizer shards), every check
    train makes of it before reading weights at the job's layout of `world` processes (resume_from: the model, the
    optimizer state's layout, the save's own files, the config's changes), a data file changed since the save
    (`prompts`: build_prompt_setup's, None where it failed) and the groups the save holds."""
    run_dir, resume = run_dir_of(cfg), cfg.checkpoint.resume
    lock = RunLock(run_dir, cfg.logging.lock_stale_after_s)
    for problem in (lock.live_holder_problem(), lock.write_problem()):  # as train's lock would meet them
        if problem is not None:
            report.problems.append(problem)
    save = None
    if resume in ("auto", "force"):
        save = find_latest_complete(checkpoint_dir_of(cfg), verify=verify_all_but_shards)
    elif resume != "none" and Path(resume).is_dir():
        save = Path(resume)
        verify_all_but_shards(save)  # train's refusal of a named save that is incomplete or damaged
    if resume == "none" and (problem := earlier_saves_problem(checkpoint_dir_of(cfg), run_dir)):
        report.problems.append(problem)
        return
    if (
        save is None
        and resume in ("auto", "force")
        and (damaged := no_intact_save_problem(resume, checkpoint_dir_of(cfg)))
    ):
        report.problems.append(damaged)
        return
    if save is not None:
        with quiet_save_reading():  # reading its common state imports Megatron-Core
            state = resume_from(cfg, save, spec, job_layout(cfg, world)).run_state
        if prompts is not None:  # the data position the save holds, checked against the file as train checks it
            stream = PromptStream(prompts.source, cfg.data.seed, prompts.fingerprint, cfg.data.allow_changed_data)
            stream.load_state_dict(state["sampler"]["prompts"])
        check_saved_groups(save, state, spec)
        report.facts.append(f"resumes {save} at step {state['step']} of {cfg.trainer.steps}")
    elif (run_dir / "metrics.jsonl").exists():
        report.facts.append(
            f"{run_dir} holds an earlier run: train moves it to {run_dir.name}.prev-<time> and starts at step 0 "
            "(checkpoint.resume=auto continues it)"
            if resume == "none"
            else f"{run_dir} holds an earlier run without a complete save: train moves it aside and starts at step 0"
        )
    else:
        report.facts.append(f"starts at step 0 in {run_dir}")


def job_layout(cfg: RunConfig, world: int) -> dict[str, int] | None:
    """The layout a job of `world` processes runs at, as its saves record it; None where the layout does not fit
    the world (check_model names that)."""
    tp, pp, vpp, ep, etp = cfg.parallel.model_layout()
    cp = cfg.parallel.context_parallel_size
    try:
        dp = check_layout(world, tp, pp, vpp, ep, etp, cp)
    except DapoError:
        return None
    return layout_for(tp, pp, vpp, dp, ep, etp, cp)


def check_saved_groups(save: Path, state: dict[str, Any], spec: ModelSpec) -> None:
    """The groups a save holds, checked as the resumed run's sampler checks them (RolloutSampler.load_state_dict):
    the carried-over ones, and partial rollout's unfinished ones, every replica's file (a resumed rank reads only
    its replica's)."""
    sampler, step = state["sampler"], int(state["step"])
    saved_groups(sampler["carry"], "carried", step, vocab_size=spec.vocab_size)
    if "pending" in sampler:
        check_saved_files(sampler["pending"], lambda name: read_own_file(save, name), step, spec.vocab_size)
    else:  # saves before the groups had owners held them in the run state
        saved_groups(sampler.get("unfinished", []), "unfinished", step, vocab_size=spec.vocab_size)


def check_memory(report: CheckReport, cfg: RunConfig, model_config: dict[str, Any], gpu_gb: float, gpus: int):
    plan = plan_memory(cfg, model_config, gpu_gb, gpus)
    peak = plan.peak
    line = f"memory plan for {gpus} GPUs of {gpu_gb:g} GiB: peak {peak.total / 2**30:.1f} GiB ({peak.name})"
    if plan.fits:
        report.facts.append(line + " fits")
        return
    report.problems.append(f"{line} does not fit: see `dapo-mcore plan` with the same arguments")


def format_report(config_path: str, report: CheckReport) -> str:
    lines = [f"dapo-mcore check: {config_path}"] + [f"  {fact}" for fact in report.facts]
    if not report.problems:
        return "\n".join([*lines, f"dapo-mcore check: {config_path} is ready to launch"])
    count = len(report.problems)
    lines.append(f"the run would not start: {count} problem{'s' if count > 1 else ''}:")
    return "\n".join(lines + [f"  - {problem}" for problem in report.problems])
