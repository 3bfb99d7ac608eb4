"""Building a run's pieces from the config tree: the only place that turns config sections into the plain
settings the components take (DESIGN.md rule 2), so components never read the config object."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from dapo_mcore.algo.losses import LossSettings, resolve_loss_agg
from dapo_mcore.checkpoint.convert import LlamaFamilyMap
from dapo_mcore.checkpoint.hf_io import check_weight_dtypes, load_hf_weights
from dapo_mcore.checkpoint.model_checkpoint import load_model_weights
from dapo_mcore.checkpoint.run_checkpoint import CheckpointManager, layout_of, read_resume_state
from dapo_mcore.config import RunConfig, dump_config, validate
from dapo_mcore.config.loader import changes_the_experiment, config_changes, config_to_dict, describe_change
from dapo_mcore.config.model_spec import ModelSpec, load_hf_config, read_model_spec
from dapo_mcore.config.validate import checkpoint_dir_of, config_warnings, eval_file_list, run_dir_of
from dapo_mcore.data.batching import DataParallelSplit
from dapo_mcore.data.datasets import PromptStream, build_prompt_source, load_jsonl_prompts, source_fingerprint
from dapo_mcore.data.templates import PromptFormatter, apply_length_policy
from dapo_mcore.data.types import NO_EXPERT, Prompt
from dapo_mcore.launch import agreed, check_all_reduce, check_this_task, path_problems, raise_shared, room_problem
from dapo_mcore.mcore.actor import (
    ActorSettings,
    MegatronActor,
    OptimizerSettings,
    PolicyRunner,
    build_actor,
    build_reference,
    packing_mode,
)
from dapo_mcore.mcore.cpu_adam import use_task_cpus
from dapo_mcore.mcore.mcore_compat import check_version as check_megatron_core_version
from dapo_mcore.mcore.provider import (
    build_gpt_chunks,
    build_transformer_config,
    check_model_layout,
    check_moe_training_layout,
    resolve_transformer_impl,
)
from dapo_mcore.parallel import (
    ParallelContext,
    StoreBoard,
    all_gather_objects,
    all_to_all_on_host,
    broadcast_object,
    destroy_parallel,
    init_parallel,
    resolve_device,
)
from dapo_mcore.parallel.gloo_net import gloo_route
from dapo_mcore.plan import checkpoint_bytes
from dapo_mcore.rewards.answers import also_rule, answer_extractor
from dapo_mcore.rewards.by_source import VerifierChoice, VerifiersBySource
from dapo_mcore.rewards.contract import ScoreRule
from dapo_mcore.rollout.base import EngineSettings, RolloutEngine, routing_unavailable, run_instance_id
from dapo_mcore.rollout.placement import engine_placement
from dapo_mcore.rollout.registry import create_engine
from dapo_mcore.rollout.sampler import RolloutSampler, SamplerSettings, reward_spread
from dapo_mcore.rollout.synthetic_engine import SyntheticSettings
from dapo_mcore.rollout.validation import EvalSettings, Validator
from dapo_mcore.utils.errors import CheckpointError, ConfigError, DataError, RunFilesError, RunLockError, os_reason
from dapo_mcore.utils.imports import import_callable
from dapo_mcore.utils.logging import get_logger, setup_logging
from dapo_mcore.utils.metrics_log import MetricsWriter, WandbOptions, roll_back_metrics
from dapo_mcore.utils.progress import RunProgress
from dapo_mcore.utils.run_lock import RunLock
from dapo_mcore.weight_sync import WeightExporter

log = get_logger(__name__)


@dataclass
class Run:
    cfg: RunConfig
    ctx: ParallelContext
    run_dir: Path
    actor: MegatronActor
    reference: PolicyRunner | None  # only when the KL penalty is on
    engine: RolloutEngine
    exporter: WeightExporter
    sampler: RolloutSampler
    verifiers: VerifiersBySource
    writer: MetricsWriter | None  # rank 0 only
    progress: RunProgress
    spec: ModelSpec
    checkpoints: CheckpointManager
    resume: Resume | None  # the save this run continues from
    validator: Validator | None = None  # only with trainer.eval_interval > 0
    lock: RunLock | None = None  # rank 0: the run directory's lock, released when the run ends


@dataclass(frozen=True)
class PromptSetup:
    """What turns data into prompts: built before the model, so bad data or a template fail fast."""

    formatter: PromptFormatter
    source: Sequence[Prompt]
    eval_sets: dict[str, list[Prompt]]
    # The data file's (datasets.source_fingerprint); None for the generated arithmetic source.
    fingerprint: dict[str, Any] | None = None


@dataclass(frozen=True)
class Resume:
    path: Path
    run_state: dict[str, Any]

    @property
    def step(self) -> int:  # the save's step: updates done, where the run continues
        return int(self.run_state["step"])


def build_run(cfg: RunConfig) -> Run:
    setup_logging(int(os.environ.get("RANK", "0")))
    validate(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        for line in config_warnings(cfg):
            log.warning(line)
    par = cfg.parallel
    tp, pp, vpp, ep, etp = par.model_layout()
    cp = par.context_parallel_size
    model_config = load_hf_config(cfg.model.hf_path)
    spec = read_model_spec(model_config)
    check_model_layout(spec, tp, pp, vpp, ep, etp)  # before any process group or allocation
    check_moe_training_layout(spec, tp, par.sequence_parallel)
    check_routing_replay(cfg, spec)
    if cfg.model.init == "hf":  # the weights' dtypes, from their headers: before an engine loads them
        note = check_weight_dtypes(cfg.model.hf_path, model_config)
        if note is not None and int(os.environ.get("RANK", "0")) == 0:
            log.warning(note)
    check_this_task(par.device, int(os.environ.get("WORLD_SIZE", "1")), tp, pp, vpp, ep, etp, cp)
    # reported once every rank joined the group, so that a problem of one node stops all ranks alike
    problems = path_problems(cfg.model.hf_path, cfg.model.init, checkpoint_dir_of(cfg))
    ctx = init_parallel(
        tp,
        pp,
        par.device,
        par.timeout_minutes,
        cfg.trainer.seed,
        vpp,
        wait_timeout_minutes=par.generation_timeout_minutes,
        ep=ep,
        etp=etp,
        peer_timeout_s=par.peer_timeout_s,
        cp=cp,
    )
    lock = None
    try:
        preflight(cfg, ctx, checkpoint_bytes(model_config, cfg.model.dtype), problems)
        lock = take_run_lock(run_dir_of(cfg), ctx, cfg.logging.lock_stale_after_s)  # before the directory is touched
        return build_pieces(cfg, ctx, spec, lock)
    except BaseException:
        if lock is not None:
            lock.release()
        destroy_parallel()  # a failed start (bad checkpoint, engine that would not start) leaves no group behind
        raise


def preflight(cfg: RunConfig, ctx: ParallelContext, save_bytes: int, path_problems_here: list[str]) -> None:
    """Before any model allocation: every rank's path problems, room for a save, an all-reduce across every
    rank (collective; the same error on every rank)."""
    hosts = raise_shared(path_problems_here)
    room = None
    if cfg.checkpoint.save_interval > 0:  # (a save on a signal alone is not promised room: it may not come)
        room = room_problem(checkpoint_dir_of(cfg), save_bytes)
    raise_shared([room] if room else [])
    where = f"{_count(ctx.world_size, 'rank')} on {_count(len(hosts), 'host')} ({_hosts_listed(hosts)})"
    if len(hosts) > 1 and gloo_route():
        where += f"; gloo on {gloo_route()}"  # this rank's host's; the wait group's traffic crosses hosts
    log.info("preflight passed on %s: %s", where, check_all_reduce(ctx.device, cfg.parallel.preflight_timeout_s))


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def _hosts_listed(hosts: list[str]) -> str:
    return ", ".join(hosts) if len(hosts) <= 4 else f"{', '.join(hosts[:3])}, ... {hosts[-1]}"


def take_run_lock(run_dir: Path, ctx: ParallelContext, stale_after_s: float) -> RunLock | None:
    """Rank 0 takes the run directory's lock; every rank raises the same one-line error when it cannot."""
    lock, refusal = None, None
    if ctx.rank == 0:
        lock = RunLock(run_dir, stale_after_s)
        try:
            lock.acquire()
        except RunLockError as err:
            refusal = str(err)
    refusal = broadcast_object(refusal, src=0)
    if refusal is not None:
        raise RunLockError(refusal)
    return lock


def build_pieces(cfg: RunConfig, ctx: ParallelContext, spec: ModelSpec, lock: RunLock | None) -> Run:
    run_dir = run_dir_of(cfg)
    checkpoints = CheckpointManager(
        checkpoint_dir_of(cfg),
        ctx,
        cfg.checkpoint.keep_last,
        hf_assets_from=cfg.model.hf_path,
        async_save=cfg.checkpoint.async_save,
        optimizer_format=cfg.checkpoint.optimizer_format,
    )
    checkpoints.remove_partials()  # the lock is held: no live run is writing them
    resume = find_resume(cfg, checkpoints, run_dir, spec)
    tokenizer = load_tokenizer(cfg.model.hf_path)
    # every rank reads the data: a file one host sees otherwise stops every rank alike (agreed)
    prompts = agreed(lambda: build_prompt_setup(cfg, tokenizer, spec))
    use_te = resolve_transformer_impl(cfg.model.transformer_impl, ctx.is_cpu, cfg.model.fp8)
    settings = actor_settings(cfg, pad_id=tokenizer.pad_token_id, use_te=use_te)
    engine = start_engine(cfg, ctx, spec)
    verifiers = None
    try:
        actor, reference, family = build_policies(cfg, ctx, spec, settings)
        exporter = WeightExporter(ctx, actor.chunks, family, bucket_bytes=cfg.rollout.weight_bucket_mb << 20)
        reward = cfg.algorithm.reward
        choice = VerifierChoice(reward.verifier, reward.verifiers, ScoreRule(reward.graded, reward.correct_threshold))
        verifiers = choice.start(
            workers=reward.workers,
            timeout_s=reward.timeout_s,
            batch_timeout_s=reward.batch_timeout_s,
            timeout_per_answer_s=reward.timeout_per_answer_s,
        )
        sampler = build_sampler(cfg, ctx, engine, prompts, verifiers, actor.dp_split)
        validator = build_validator(cfg, ctx, engine, prompts, verifiers)
        prepare_run_dir(cfg, ctx, run_dir, resume, checkpoints)  # every check passed: now the directory changes
    except BaseException:
        if verifiers is not None:
            verifiers.close()
        engine.shutdown()
        raise
    writer = None
    if ctx.rank == 0:
        run_id = resume.run_state.get("wandb_run_id") if resume else None
        writer = MetricsWriter(run_dir, wandb_options(cfg), cfg.name, config_to_dict(cfg), run_id=run_id)
    progress = RunProgress(enabled=ctx.rank == 0 and cfg.logging.progress, total_steps=cfg.trainer.steps)
    return Run(
        cfg,
        ctx,
        run_dir,
        actor,
        reference,
        engine,
        exporter,
        sampler,
        verifiers,
        writer,
        progress,
        spec,
        checkpoints,
        resume,
        validator,
        lock,
    )


def start_engine(cfg: RunConfig, ctx: ParallelContext, spec: ModelSpec) -> RolloutEngine:
    """The rollout engine, started before the actor allocates anything on the GPU: vLLM refuses to start unless
    rollout.gpu_memory_utilization x the GPU is free (the plan's "engine start" line), which the actor's
    weights, gradient buffers and optimizer state would take (30B-A3B: 35 of the 47.5 GiB asked). It then
    sleeps (its KV cache and weights released) so the actor can be built; the first weight push wakes it."""
    settings = engine_settings(cfg, ctx, routing=returns_routing(cfg, spec))
    with torch.random.fork_rng(devices=[]):  # an engine's own initialisation must not move the run's streams
        if cfg.rollout.engine == "synthetic":  # the rehearsals' stand-in: its knobs and the run's length
            knobs = SyntheticSettings.of(cfg.rollout.synthetic, cfg.trainer.steps)
            engine = create_engine(cfg.rollout.engine, settings, synthetic=knobs)
        else:
            engine = create_engine(cfg.rollout.engine, settings)
    engine.release_memory()
    return engine


def build_policies(
    cfg: RunConfig, ctx: ParallelContext, spec: ModelSpec, settings: ActorSettings
) -> tuple[MegatronActor, PolicyRunner | None, LlamaFamilyMap]:
    """The actor (with DDP and its optimizer) and, with a KL penalty, the frozen reference policy."""
    check_megatron_core_version()
    chunks, family = load_policy_chunks(cfg, ctx, spec)
    actor = build_actor(ctx, spec, chunks, optimizer_settings(cfg), settings)
    if cfg.optimizer.cpu_offload:  # its Adam steps on the host: on the task's CPUs, not OMP_NUM_THREADS' one
        use_task_cpus(actor.optimizer)
    reference = None
    if cfg.algorithm.kl.beta > 0.0:  # the paper has no KL term: then no reference model is built or run
        reference = build_reference(ctx, spec, load_policy_chunks(cfg, ctx, spec)[0], settings)
        log.info(
            "KL penalty on (beta=%g, %s): reference model built", cfg.algorithm.kl.beta, cfg.algorithm.kl.estimator
        )
    else:
        log.info("KL penalty off (algorithm.kl.beta=0): no reference model")
    return actor, reference, family


def load_policy_chunks(cfg: RunConfig, ctx: ParallelContext, spec: ModelSpec) -> tuple[list[Any], LlamaFamilyMap]:
    use_te = resolve_transformer_impl(cfg.model.transformer_impl, ctx.is_cpu, cfg.model.fp8)
    tconfig = build_transformer_config(
        spec,
        tp=ctx.tp_size,
        pp=ctx.pp_size,
        dtype=cfg.model.dtype,
        on_cpu=ctx.is_cpu,
        use_te=use_te,
        vpp=ctx.vpp_size,
        sequence_parallel=cfg.parallel.sequence_parallel,
        fp8=cfg.model.fp8,
        fp8_recipe=cfg.model.fp8_recipe,
        fp8_first_last_layers_bf16=cfg.model.fp8_first_last_layers_bf16,
        recompute=cfg.model.recompute,
        recompute_num_layers=cfg.model.recompute_num_layers,
        ep=ctx.ep_size,
        etp=ctx.etp_size,
        moe_aux_loss_coeff=cfg.model.moe_aux_loss_coeff,
        moe_dispatcher=cfg.model.moe_token_dispatcher,
        cp=ctx.cp_size,
    )
    torch.manual_seed(cfg.model.init_seed)  # the same full initial weights at any layout
    chunks = build_gpt_chunks(spec, tconfig, ctx=ctx, use_te=use_te)
    family = LlamaFamilyMap(spec, te_layer_names=use_te)
    if cfg.model.init == "hf":  # conversion on the fly: HF tensors mapped into this rank's shards
        load_hf_weights(chunks, cfg.model.hf_path, family, ctx.tp_rank, ctx.tp_size, ctx.etp_rank, ctx.etp_size)
    elif cfg.model.init == "mcore":
        load_model_weights(chunks, Path(cfg.model.mcore_path), spec)
    return chunks, family


def loss_settings(cfg: RunConfig) -> LossSettings:
    algo = cfg.algorithm
    mm = algo.mismatch
    return LossSettings(
        clip_low=algo.clip_low,
        clip_high=algo.clip_high,
        dual_clip_c=algo.dual_clip_c,
        agg_mode=resolve_loss_agg(algo.policy_loss, algo.loss_agg),
        norm_len=algo.loss_norm_len or cfg.rollout.sampling.max_response_len,
        kl_beta=algo.kl.beta,
        kl_estimator=algo.kl.estimator,
        entropy_coeff=algo.entropy_coeff,
        tis=mm.tis,
        tis_cap=mm.tis_cap,
        seq_mask_low=mm.seq_mask_low,
        seq_mask_high=mm.seq_mask_high,
        early_stop_ratio=mm.early_stop_ratio,
        token_mask_low=mm.token_mask_low,
        token_mask_high=mm.token_mask_high,
        policy_loss=algo.policy_loss,
        gspo_clip_low=algo.gspo.clip_low,
        gspo_clip_high=algo.gspo.clip_high,
        cispo_clip_low=algo.cispo.clip_low,
        cispo_clip_high=algo.cispo.clip_high,
        sapo_tau_pos=algo.sapo.tau_pos,
        sapo_tau_neg=algo.sapo.tau_neg,
    )


def actor_settings(cfg: RunConfig, pad_id: int, use_te: bool = False) -> ActorSettings:
    return ActorSettings(
        micro_batch_size=cfg.trainer.micro_batch_size,
        temperature=cfg.rollout.sampling.temperature,
        pad_id=pad_id,
        loss=loss_settings(cfg),
        fused_logprobs=cfg.model.fused_logprobs,
        logprob_chunk_size=cfg.model.logprob_chunk_size,
        fused_loss_grad=cfg.model.fused_loss_grad,
        max_tokens_per_micro_batch=cfg.trainer.max_tokens_per_micro_batch,
        packing=packing_mode(cfg.trainer.packing, use_te),
        routing_replay=cfg.model.routing_replay == "rollout",
        rehearsal_micro_batches=cfg.trainer.rehearsal_micro_batches,
    )


def optimizer_settings(cfg: RunConfig) -> OptimizerSettings:
    opt = cfg.optimizer
    return OptimizerSettings(
        lr=opt.lr,
        min_lr=opt.min_lr,
        warmup_steps=opt.warmup_steps,
        total_steps=cfg.trainer.steps,
        weight_decay=opt.weight_decay,
        clip_grad=opt.clip_grad,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
        cpu_offload=opt.cpu_offload,
        offload_fraction=opt.offload_fraction,
    )


def check_routing_replay(cfg: RunConfig, spec: ModelSpec) -> None:
    """model.routing_replay=rollout needs a mixture-of-experts model and an engine that returns its routing."""
    if cfg.model.routing_replay == "off":
        return
    if not spec.is_moe:
        raise ConfigError(
            f"model.routing_replay={cfg.model.routing_replay}: {cfg.model.hf_path} has no experts to route"
        )
    problem = routing_unavailable(cfg.rollout.engine, _engine_device(cfg))
    if problem:
        raise ConfigError(f"model.routing_replay={cfg.model.routing_replay}: {problem}")
    if spec.num_experts > NO_EXPERT:
        raise ConfigError(
            f"model.routing_replay={cfg.model.routing_replay}: {spec.num_experts} experts do not fit the routing's "
            f"uint8 expert ids (at most {NO_EXPERT}); use model.routing_replay=off"
        )


def returns_routing(cfg: RunConfig, spec: ModelSpec) -> bool:
    """Whether the engine is asked for its routing: only for routing replay (model.routing_replay=rollout). It
    costs layers x top-k bytes a token (384 at 30B-A3B, 48 x the token and its log-prob) from the engine to
    the ranks that train each answer; without replay nothing would use it but the agreement metric."""
    return spec.is_moe and cfg.model.routing_replay == "rollout"


def _engine_device(cfg: RunConfig) -> str:
    """The device type the run asks for: "cuda" as written (`check` runs on a login node, without a GPU), "auto"
    as this machine resolves it."""
    return cfg.parallel.device if cfg.parallel.device != "auto" else resolve_device("auto").type


def engine_settings(cfg: RunConfig, ctx: ParallelContext, routing: bool = False) -> EngineSettings:
    ro = cfg.rollout
    # torchrun and slurm/train.sbatch set LOCAL_RANK; a one-process run has none (parallel/state.py sets 0).
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    placement = engine_placement(ctx.rank, local_rank, ctx.world_size, ro.engine_tp_size, ctx.device.type)
    return EngineSettings(
        model_path=cfg.model.hf_path,
        device=str(ctx.device),
        dtype=cfg.model.dtype,
        # Weights arrive from the actor before the first generate, so the engine skips loading its own.
        load_weights=False,
        tp_size=ro.engine_tp_size,
        memory_fraction=ro.gpu_memory_utilization,
        cpu_kv_cache_mb=ro.cpu_kv_cache_mb,
        max_num_batched_tokens=ro.max_num_batched_tokens,
        max_model_len=ro.max_model_len,
        enable_prefix_caching=ro.enable_prefix_caching,
        cuda_graphs=ro.cuda_graphs,
        sleep_level=ro.sleep_level,
        seed=ro.seed,
        weight_bucket_mb=ro.weight_bucket_mb,
        placement=placement,
        return_routed_experts=routing,
        engine_log=cfg.logging.engine_log,
        instance_id=run_instance_id(run_dir_of(cfg)),
    )


def wandb_options(cfg: RunConfig) -> WandbOptions:
    wb = cfg.logging.wandb
    quiet = cfg.logging.engine_log == "quiet"
    return WandbOptions(wb.mode, wb.project, wb.entity, wb.group, list(wb.tags), quiet=quiet)


def sampler_settings(cfg: RunConfig) -> SamplerSettings:
    ro, algo = cfg.rollout, cfg.algorithm
    over, linear, ds = algo.overlong, algo.length_penalty, algo.dynamic_sampling
    return SamplerSettings(
        n_samples_per_prompt=ro.n_samples_per_prompt,
        prompts_per_step=ro.prompts_per_step,
        gen_prompts_per_round=ro.gen_prompts_per_round,
        temperature=ro.sampling.temperature,
        top_p=ro.sampling.top_p,
        max_response_len=ro.sampling.max_response_len,
        seed=ro.seed,
        reward_correct=algo.reward.correct,
        reward_wrong=algo.reward.wrong,
        adv_estimator=algo.advantage.estimator,
        adv_eps=algo.advantage.eps,
        adv_batch_normalize=algo.advantage.batch_normalize,
        overlong_enabled=over.enabled,
        overlong_buffer_len=over.buffer_len,
        overlong_penalty_factor=over.penalty_factor,
        overlong_filter=over.filter_truncated,
        length_penalty=linear.enabled,
        length_penalty_coef=linear.coef,
        length_penalty_safe_len=linear.safe_len,
        length_penalty_max_len=linear.max_len,
        dynamic_sampling=ds.enabled,
        carry_surplus=ro.carry_surplus,
        partial_rollout=ro.partial_rollout,
        partial_oversample=ro.partial_oversample,
        partial_max_staleness=ro.partial_max_staleness,
        mode=ds.mode,
        max_rounds=ds.max_rounds,
        on_cap=ds.on_cap,
        adaptive=ds.adaptive,
        adaptive_min_prompts=ds.adaptive_min_prompts,
        adaptive_max_prompts=ds.adaptive_max_prompts,
    )


def build_prompt_setup(cfg: RunConfig, tokenizer: Any, spec: ModelSpec) -> PromptSetup:
    data = cfg.data
    limit, where = prompt_length_limit(cfg, spec)
    keep_last = limit if data.long_prompts == "truncate_left" else 0
    formatter = PromptFormatter(tokenizer, data.template, data.instruction, data.system_prompt, keep_last)
    measure = PromptFormatter(tokenizer, data.template, data.instruction, data.system_prompt)  # untruncated
    source = build_prompt_source(
        data.source, data.prompt_key, data.answer_key, data.min_operand, data.max_operand, data.ops
    )
    files = {data.source: source} if data.source != "arithmetic" else {}
    if cfg.trainer.eval_interval > 0:
        files |= {
            name: load_jsonl_prompts(name, data.prompt_key, data.answer_key) for name in eval_file_list(data.eval_files)
        }
    for name, prompts in files.items():
        files[name], over = apply_length_policy(prompts, measure, limit, data.long_prompts, where)
        if over:
            done = "left out" if data.long_prompts == "drop" else "cut to their last tokens"
            log.warning("%s: %d prompts longer than %d tokens (%s) %s (data.long_prompts=%s)",
                        name, over, limit, where, done, data.long_prompts)  # fmt: skip
        if not files[name]:
            raise DataError(f"{name}: every prompt is longer than {limit} tokens ({where})")
    fingerprint = None
    if data.source != "arithmetic":
        source = files.pop(data.source)
        fingerprint = source_fingerprint(data.source, source)
    return PromptSetup(formatter, source, files, fingerprint)


def prompt_length_limit(cfg: RunConfig, spec: ModelSpec) -> tuple[int, str]:
    """The longest prompt allowed, in tokens, and where that figure comes from."""
    if cfg.data.max_prompt_len > 0:
        return cfg.data.max_prompt_len, "data.max_prompt_len"
    limit = spec.max_position_embeddings - cfg.rollout.sampling.max_response_len
    if limit < 1:
        raise ConfigError(
            f"rollout.sampling.max_response_len={cfg.rollout.sampling.max_response_len} leaves no room for a prompt "
            f"in the model's {spec.max_position_embeddings} positions"
        )
    return limit, f"the model's {spec.max_position_embeddings} positions minus max_response_len"


def build_sampler(
    cfg: RunConfig,
    ctx: ParallelContext,
    engine: RolloutEngine,
    prompts: PromptSetup,
    verifiers: VerifiersBySource,
    dp_split: DataParallelSplit,
) -> RolloutSampler:
    """The sampler; it sends each chosen sample's tokens only to the ranks of the DP rank that trains it
    (dp_split: the actor's own deal, over the trainer's mini-batches), over the host (the gloo wait group)."""
    filter_spec = cfg.algorithm.dynamic_sampling.filter
    keep_filter = import_callable(filter_spec, "dynamic-sampling filter") if filter_spec else reward_spread
    if cfg.rollout.partial_rollout and cfg.algorithm.mismatch.tis == "none" and ctx.rank == 0:
        log.warning(
            "rollout.partial_rollout without algorithm.mismatch.tis: the tokens of older weights train "
            "uncorrected (on the demo that cost held-out accuracy: docs/partial_rollout.md); add "
            "algorithm.mismatch.tis=token"
        )
    return RolloutSampler(
        engine,
        prompts.formatter,
        PromptStream(prompts.source, cfg.data.seed, prompts.fingerprint, cfg.data.allow_changed_data),
        verifiers.verify,
        sampler_settings(cfg),
        rank=ctx.rank,
        world_size=ctx.world_size,
        all_gather=partial(all_gather_objects, group=ctx.wait_group),  # after generating: a long wait
        keep_filter=keep_filter,
        engine_tp_size=cfg.rollout.engine_tp_size,
        exchange=partial(all_to_all_on_host, group=ctx.wait_group),
        dp_rank_of=all_gather_objects(ctx.dp_rank),
        trainers_of=partial(dp_split.trainers, mini_batch_size=cfg.trainer.mini_batch_size),
        # a read waits for the leader's verdicts or the stop news: as long as replicas wait for each other
        board=StoreBoard("dapo/rollout/", timeout_minutes=cfg.parallel.generation_timeout_minutes),
    )


def build_validator(
    cfg: RunConfig, ctx: ParallelContext, engine: RolloutEngine, prompts: PromptSetup, verifiers: VerifiersBySource
) -> Validator | None:
    if not prompts.eval_sets:
        return None
    tp = cfg.rollout.engine_tp_size
    settings = eval_settings(cfg, n_replicas=ctx.world_size // tp)
    return Validator(
        prompts.eval_sets,
        engine,
        prompts.formatter,
        verifiers.verify,
        answer_extractor(cfg.algorithm.reward.verifier),
        settings,
        replica=ctx.rank // tp,
        n_replicas=ctx.world_size // tp,
        all_gather=partial(all_gather_objects, group=ctx.wait_group),  # after generating: a long wait
        engine_tp_size=tp,
        also={rule: also_rule(rule) for rule in eval_file_list(cfg.trainer.eval_also_verifiers)},
    )


def eval_settings(cfg: RunConfig, n_replicas: int) -> EvalSettings:
    tr = cfg.trainer
    return EvalSettings(
        k=tr.eval_k,
        temperature=tr.eval_temperature,
        top_p=tr.eval_top_p,
        max_new_tokens=tr.eval_max_response_len or cfg.rollout.sampling.max_response_len,
        seed=cfg.rollout.seed,
        prompts_per_call=max(1, cfg.rollout.gen_prompts_per_round // n_replicas),
    )


def load_tokenizer(hf_path: str) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def find_resume(cfg: RunConfig, checkpoints: CheckpointManager, run_dir: Path, spec: ModelSpec) -> Resume | None:
    """The save named by checkpoint.resume (none / auto / force / a path), with its run state; the same on every rank.
    Checked against the configured model before the run directory or any weight is touched. Every rank reads the
    files; a refusal any rank meets (a file its host does not see) is every rank's (launch.agreed)."""
    choice = cfg.checkpoint.resume
    if choice == "none":
        agreed(lambda: _refuse(earlier_saves_problem(checkpoints.root, run_dir)))
        return None
    newest = choice in ("auto", "force")
    path = checkpoints.latest_complete() if newest else checkpoints.verified(Path(choice))
    if path is None:
        agreed(lambda: _refuse(no_intact_save_problem(choice, checkpoints.root)))
        log.info("checkpoint.resume=%s: no complete save in %s, starting from step 0", choice, checkpoints.root)
        return None
    resume = agreed(lambda: resume_from(cfg, path, spec, layout_of(checkpoints.ctx)))
    log.info("resuming from %s at step %d", path, resume.step)
    return resume


def _refuse(problem: str | None) -> None:
    if problem:
        raise CheckpointError(problem)


def resume_from(cfg: RunConfig, path: Path, spec: ModelSpec, layout: dict[str, int] | None) -> Resume:
    """The save `path` as a run at `layout` resumes it: every check made before a weight is read
    (read_resume_state: the model, the optimizer's layout, the save's own files) and the config's changes since the
    save (check_config_changes). `dapo-mcore check` runs this same function for the job's layout."""
    resume = Resume(path, read_resume_state(path, spec, layout))
    check_config_changes(cfg, resume)
    return resume


def no_intact_save_problem(choice: str, checkpoint_dir: Path) -> str | None:
    """checkpoint.resume=auto / force found saves, none of them complete and intact: refused (it moved the run
    aside and retrained from step 0, exit 0, with only the skips logged)."""
    damaged = sorted(p.name for p in checkpoint_dir.glob("step_*") if p.is_dir())
    if not damaged:
        return None
    return (
        f"checkpoint.resume={choice}: none of the {len(damaged)} saves in {checkpoint_dir} is complete and intact "
        f"({', '.join(damaged)}: why, above); nothing to continue from: restore a save, or set "
        "checkpoint.resume=none to start over (the run directory is then moved aside, its saves kept)"
    )


def earlier_saves_problem(checkpoint_dir: Path, run_dir: Path) -> str | None:
    """A fresh run (checkpoint.resume=none) whose checkpoint.dir, outside its run directory (which is moved
    aside), holds another run's saves: its saves would mix with them."""
    outside_run_dir = not checkpoint_dir.resolve().is_relative_to(run_dir.resolve())
    if outside_run_dir and any(checkpoint_dir.glob("step_*")):
        return (
            f"checkpoint.dir {checkpoint_dir} holds saves of an earlier run: continue it with "
            "checkpoint.resume=auto, or give this run another checkpoint.dir"
        )
    return None


def check_config_changes(cfg: RunConfig, resume: Resume) -> None:
    """checkpoint.resume=auto refuses a config that changes the experiment since the save (config/loader.py
    SAME_EXPERIMENT_KEYS: anything but its length, paths, layout, logging, saving, timeouts and speed settings),
    naming the keys: the run directory is a recipe's name, and a recipe edited (or derived) and run again
    would otherwise continue the old experiment's weights, metrics and wandb run. Every other change, and all
    of them with resume=force or a save's path, is listed in one warning. (The model's shape was checked
    against the save already: a change there is refused.)"""
    saved = resume.run_state.get("config")
    if saved is None:  # a save from before configs were kept
        return
    now = config_to_dict(cfg)
    for section in (saved, now):
        section.get("checkpoint", {}).pop("resume", None)
        algo = section.get("algorithm", {})  # loss_agg=auto compared as what it resolves to (saves before auto)
        if "loss_agg" in algo:
            algo["loss_agg"] = resolve_loss_agg(algo.get("policy_loss", "dapo"), algo["loss_agg"])
    changes = config_changes(saved, now)
    experiment = [change for change in changes if changes_the_experiment(change)]
    if experiment and cfg.checkpoint.resume == "auto":
        raise ConfigError(
            f"checkpoint.resume=auto: {resume.path} is another experiment: {len(experiment)} config keys differ "
            f"from its save ({'; '.join(map(describe_change, experiment))}); give this run its own name (or "
            "logging.run_dir), or set checkpoint.resume=force to continue that run with the new values"
        )
    changes = [change for change in changes if change[0] not in ORDINARY_ON_RESUME]
    if changes and os.environ.get("RANK", "0") == "0":  # once, not once a rank
        log.warning("resuming from %s with %d config keys changed since the save: %s",
                    resume.path.name, len(changes), "; ".join(map(describe_change, changes)))  # fmt: skip


# What every ordinary continuation changes (a longer run, the run directory where it is now): not listed.
ORDINARY_ON_RESUME = ("trainer.steps", "logging.run_dir")


def prepare_run_dir(
    cfg: RunConfig, ctx: ParallelContext, run_dir: Path, resume: Resume | None, checkpoints: CheckpointManager
) -> None:
    """Create the run directory (rank 0), moving a previous run's files aside rather than overwriting; when
    resuming, keep it, set aside saves newer than the resumed one and move the metrics of steps that are run
    again to metrics.rolled_back.jsonl. Called once the run has passed every check (data, engine, model): a
    run that fails to start leaves the directory as it found it."""
    if resume is not None:
        checkpoints.set_aside_after(resume.step)
    failure = None
    if ctx.rank == 0:
        try:
            _prepare_run_dir_files(cfg, run_dir, resume)
        except OSError as err:  # a read-only or full file system, a quota, no permission
            where = err.filename if err.filename is not None else run_dir
            failure = (
                f"logging.run_dir {run_dir}: cannot write {where} ({os_reason(err)}); choose a logging.run_dir "
                "where this job can write"
            )
    failure = broadcast_object(failure, src=0)  # (as the barrier it replaces: every rank waits for the directory)
    if failure is not None:
        error = RunFilesError(failure)
        error.same_on_every_rank = True  # every rank raises rank 0's line: printed once
        raise error


def _prepare_run_dir_files(cfg: RunConfig, run_dir: Path, resume: Resume | None) -> None:
    if resume is not None:
        rolled_back = roll_back_metrics(run_dir / "metrics.jsonl", resume.step + 1)  # row N: N updates done
        if rolled_back:
            log.warning("%d metric rows after step %d moved to metrics.rolled_back.jsonl", rolled_back, resume.step)
        if (run_dir / "config.yaml").exists():
            stamp = time.strftime("%Y%m%d-%H%M%S")
            shutil.copy2(run_dir / "config.yaml", run_dir / f"config.before-resume-{stamp}.yaml")
    elif (run_dir / "metrics.jsonl").exists():
        kept = run_dir.with_name(f"{run_dir.name}.prev-{time.strftime('%Y%m%d-%H%M%S')}")
        shutil.move(str(run_dir), str(kept))
        log.warning("run directory %s held an earlier run; moved it to %s", run_dir, kept)
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(cfg, run_dir / "config.yaml")
    log.info("run directory: %s", run_dir)
