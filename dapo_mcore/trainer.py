"""One DAPO run: build the pieces, then loop generate -> score/filter -> old log-probs -> update -> push.

prompts -> engine.generate (n per prompt) -> reward + overlong shaping -> dynamic-sampling filter
   ^                                                                            | (resample until full)
   |                                                                            v
engine.update_weights <- weight export (TP/PP gather -> HF names -> buckets) <- actor update
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dapo_mcore.checkpoint.convert import LlamaFamilyMap
from dapo_mcore.checkpoint.hf_io import load_hf_weights
from dapo_mcore.config import RunConfig, dump_config, validate
from dapo_mcore.config.loader import config_to_dict
from dapo_mcore.data.datasets import PromptStream, build_prompt_source
from dapo_mcore.mcore.actor import ActorSettings, MegatronActor, OptimizerSettings, build_actor
from dapo_mcore.mcore.provider import (
    build_gpt_chunks,
    build_transformer_config,
    check_model_layout,
    load_hf_config,
    read_model_spec,
    resolve_transformer_impl,
)
from dapo_mcore.parallel import ParallelContext, all_gather_objects, destroy_parallel, init_parallel
from dapo_mcore.rewards.dapo_rule import is_correct
from dapo_mcore.rollout.base import RolloutEngine
from dapo_mcore.rollout.registry import create_engine
from dapo_mcore.rollout.sampler import RolloutSampler, SamplerSettings
from dapo_mcore.utils.logging import get_logger, setup_logging
from dapo_mcore.utils.metrics_log import MetricsWriter
from dapo_mcore.utils.plot import plot_run
from dapo_mcore.utils.progress import RunProgress
from dapo_mcore.utils.timers import PhaseTimer
from dapo_mcore.weight_sync import WeightExporter

log = get_logger(__name__)


@dataclass
class Run:
    cfg: RunConfig
    ctx: ParallelContext
    run_dir: Path
    actor: MegatronActor
    engine: RolloutEngine
    exporter: WeightExporter
    sampler: RolloutSampler
    writer: MetricsWriter | None  # rank 0 only
    progress: RunProgress


def train(cfg: RunConfig) -> Path:
    """Run cfg.trainer.steps RL steps; returns the run directory."""
    run = build_run(cfg)
    try:
        run.exporter.push(run.engine)  # the engines sample from the actor's weights from step 0 on
        with run.progress:
            for step in range(cfg.trainer.steps):
                metrics = rl_step(run, step)
                report(run, step, metrics)
    finally:
        finish(run)
    return run.run_dir


def rl_step(run: Run, step: int) -> dict[str, float]:
    timer = PhaseTimer(sync=torch.cuda.synchronize if run.ctx.device.type == "cuda" else None)
    start = time.perf_counter()
    run.engine.resume_memory()
    batch = run.sampler.next_batch(step, timer, on_round=run.progress.round_done)
    run.engine.release_memory()
    samples = batch.samples
    mini_batches = split_mini_batches(len(samples), run.cfg.trainer.mini_batch_size)
    with timer.phase("old_logprobs"):
        run.actor.compute_old_logprobs(samples, mini_batches)
    with timer.phase("update"):
        actor_metrics = run.actor.train_step(samples, mini_batches)
    with timer.phase("weight_push"):
        run.exporter.push(run.engine)
    return {**batch.metrics, **actor_metrics, **timer.pop(), "time/step_s": time.perf_counter() - start}


def split_mini_batches(n_samples: int, mini_batch_size: int) -> list[list[int]]:
    """Consecutive index ranges of at most mini_batch_size samples: one optimizer update each."""
    return [list(range(i, min(i + mini_batch_size, n_samples))) for i in range(0, n_samples, mini_batch_size)]


def report(run: Run, step: int, metrics: dict[str, float]) -> None:
    run.progress.step_done(step, metrics)
    if run.writer is None:
        return
    run.writer.write(step, metrics)
    interval = run.cfg.logging.plot_interval
    if interval > 0 and (step + 1) % interval == 0:
        plot_run(run.writer.path, run.run_dir / "curves.png", title=run.cfg.name)


# ----- building the pieces -------------------------------------------------------------------------------
def build_run(cfg: RunConfig) -> Run:
    setup_logging(int(os.environ.get("RANK", "0")))
    validate(cfg)
    spec = read_model_spec(load_hf_config(cfg.model.hf_path))
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    check_model_layout(spec, tp, pp)  # before any process group or allocation
    ctx = init_parallel(tp, pp, cfg.parallel.device, cfg.parallel.timeout_minutes, seed=cfg.trainer.seed)
    run_dir = prepare_run_dir(cfg, ctx)
    tokenizer = load_tokenizer(cfg.model.hf_path)
    actor, family = build_policy(cfg, ctx, spec, pad_id=tokenizer.pad_token_id)
    engine = create_engine(cfg.rollout.engine, **engine_kwargs(cfg, ctx))
    exporter = WeightExporter(ctx, actor.chunks, family, bucket_bytes=cfg.rollout.weight_bucket_mb << 20)
    sampler = build_sampler(cfg, ctx, engine, tokenizer)
    writer = None
    if ctx.rank == 0:
        writer = MetricsWriter(
            run_dir, cfg.logging.wandb.mode, cfg.logging.wandb.project, cfg.name, config_to_dict(cfg)
        )
    progress = RunProgress(enabled=ctx.rank == 0 and cfg.logging.progress, total_steps=cfg.trainer.steps)
    return Run(cfg, ctx, run_dir, actor, engine, exporter, sampler, writer, progress)


def build_policy(cfg: RunConfig, ctx: ParallelContext, spec: Any, pad_id: int) -> tuple[MegatronActor, LlamaFamilyMap]:
    use_te = resolve_transformer_impl(cfg.model.transformer_impl, ctx.is_cpu)
    tconfig = build_transformer_config(
        spec, tp=ctx.tp_size, pp=ctx.pp_size, dtype=cfg.model.dtype, on_cpu=ctx.is_cpu, use_te=use_te
    )
    torch.manual_seed(cfg.model.init_seed)  # the same full initial weights at any layout
    chunks = build_gpt_chunks(
        spec,
        tconfig,
        pg=ctx.pg,
        pre_process=ctx.is_first_stage,
        post_process=ctx.is_last_stage,
        use_te=use_te,
        tp=ctx.tp_size,
    )
    family = LlamaFamilyMap(spec, te_layer_names=use_te)
    if cfg.model.init == "hf":
        load_hf_weights(chunks, cfg.model.hf_path, family, ctx.tp_rank, ctx.tp_size)
    opt, tr = cfg.optimizer, cfg.trainer
    actor = build_actor(
        ctx,
        spec,
        chunks,
        OptimizerSettings(
            lr=opt.lr,
            min_lr=opt.min_lr,
            warmup_steps=opt.warmup_steps,
            total_steps=tr.steps,
            weight_decay=opt.weight_decay,
            clip_grad=opt.clip_grad,
            adam_beta1=opt.adam_beta1,
            adam_beta2=opt.adam_beta2,
            adam_eps=opt.adam_eps,
            use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        ),
        ActorSettings(
            clip_low=cfg.algorithm.clip_low,
            clip_high=cfg.algorithm.clip_high,
            temperature=cfg.rollout.sampling.temperature,
            micro_batch_size=tr.micro_batch_size,
            pad_id=pad_id,
        ),
    )
    return actor, family


def engine_kwargs(cfg: RunConfig, ctx: ParallelContext) -> dict[str, Any]:
    # Weights arrive from the actor before the first generate, so the engine skips loading its own.
    return {"model_path": cfg.model.hf_path, "device": str(ctx.device), "dtype": cfg.model.dtype, "load_weights": False}


def build_sampler(cfg: RunConfig, ctx: ParallelContext, engine: RolloutEngine, tokenizer: Any) -> RolloutSampler:
    ro, algo, data = cfg.rollout, cfg.algorithm, cfg.data
    source = build_prompt_source(
        data.source, data.prompt_key, data.answer_key, data.min_operand, data.max_operand, data.ops
    )
    settings = SamplerSettings(
        n_samples_per_prompt=ro.n_samples_per_prompt,
        prompts_per_step=ro.prompts_per_step,
        gen_prompts_per_round=ro.gen_prompts_per_round,
        temperature=ro.sampling.temperature,
        top_p=ro.sampling.top_p,
        max_response_len=ro.sampling.max_response_len,
        seed=ro.seed,
        reward_correct=algo.reward_correct,
        reward_wrong=algo.reward_wrong,
        adv_eps=algo.adv_eps,
        overlong_enabled=algo.overlong.enabled,
        overlong_buffer_len=algo.overlong.buffer_len,
        overlong_penalty_factor=algo.overlong.penalty_factor,
        overlong_filter=algo.overlong.filter_truncated,
        dynamic_sampling=algo.dynamic_sampling.enabled,
        max_rounds=algo.dynamic_sampling.max_rounds,
        on_cap=algo.dynamic_sampling.on_cap,
    )
    return RolloutSampler(
        engine,
        tokenizer,
        PromptStream(source, data.seed),
        is_correct,
        settings,
        rank=ctx.rank,
        world_size=ctx.world_size,
        all_gather=all_gather_objects,
    )


def load_tokenizer(hf_path: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def prepare_run_dir(cfg: RunConfig, ctx: ParallelContext) -> Path:
    """Create the run directory (rank 0), moving a previous run's files aside rather than overwriting."""
    run_dir = Path(cfg.logging.run_dir or f"runs/{cfg.name}")
    if ctx.rank == 0:
        if (run_dir / "metrics.jsonl").exists():
            kept = run_dir.with_name(f"{run_dir.name}.prev-{time.strftime('%Y%m%d-%H%M%S')}")
            shutil.move(str(run_dir), str(kept))
            log.warning("run directory %s held an earlier run; moved it to %s", run_dir, kept)
        run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, run_dir / "config.yaml")
        log.info("run directory: %s", run_dir)
    torch.distributed.barrier()
    return run_dir


def finish(run: Run) -> None:
    if run.writer is not None:
        if run.writer.path.exists():
            plot_run(run.writer.path, run.run_dir / "curves.png", title=run.cfg.name)
        run.writer.close()
    run.engine.shutdown()
    destroy_parallel()
