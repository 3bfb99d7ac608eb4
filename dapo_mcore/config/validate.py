"""Cross-field checks of a resolved config that need no process group or model (those live in parallel/
and mcore/). Each failure names the keys involved and their values."""

from __future__ import annotations

import math
from dataclasses import fields, is_dataclass
from pathlib import Path

from dapo_mcore.config.schema import PAPERS_LOSS_AGG, RunConfig
from dapo_mcore.utils.errors import ConfigError

# The shortest parallel.peer_timeout_s a run may set (0 aside: no watch); the ranks then beat every 5/6 s.
MIN_PEER_TIMEOUT_S = 5.0


def validate(cfg: RunConfig) -> None:
    """The first problem, as a ConfigError."""
    for check in _SECTIONS:
        check(cfg)


def config_problems(cfg: RunConfig) -> list[str]:
    """Every section's first problem (`dapo-mcore check` lists them all at once)."""
    problems = []
    for check in _SECTIONS:
        try:
            check(cfg)
        except ConfigError as err:
            problems.append(str(err))
    return problems


# tis=sequence past this many response tokens: the product of the weights goes to 0 or the cap
LONG_SEQUENCE_TIS = 4096


def config_warnings(cfg: RunConfig) -> list[str]:
    """Settings that run but likely not as meant, one line each (logged at the start of a run, listed by
    `dapo-mcore check`)."""
    algo = cfg.algorithm
    lines = []
    papers = PAPERS_LOSS_AGG.get(algo.policy_loss)
    if papers is not None and algo.loss_agg not in ("auto", papers):
        lines.append(
            f"algorithm.policy_loss={algo.policy_loss} with algorithm.loss_agg={algo.loss_agg}: the {algo.policy_loss} "
            f"paper (and verl) average each sequence's tokens, then the sequences ({papers}, what loss_agg=auto gives "
            f"{algo.policy_loss})"
        )
    max_len = cfg.rollout.sampling.max_response_len
    if algo.mismatch.tis == "sequence" and max_len > LONG_SEQUENCE_TIS:
        lines.append(
            f"algorithm.mismatch.tis=sequence with rollout.sampling.max_response_len={max_len}: the product of "
            f"{max_len} token weights is mostly 0 or the cap; tis=sequence_geometric weights by their geometric mean"
        )
    return lines


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_parallel(cfg: RunConfig) -> None:
    """Sizes the layout arithmetic divides by (a 0 was a ZeroDivisionError traceback); the peer watch's timeout."""
    par = cfg.parallel
    for name in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "virtual_pipeline_model_parallel_size",
        "expert_model_parallel_size",
        "context_parallel_size",
    ):
        _require(getattr(par, name) >= 1, f"parallel.{name} must be >= 1, got {getattr(par, name)}")
    _require(
        par.expert_tensor_parallel_size >= 0,
        f"parallel.expert_tensor_parallel_size must be >= 0 (0: the same as TP), got {par.expert_tensor_parallel_size}",
    )
    _require(
        par.peer_timeout_s == 0 or par.peer_timeout_s >= MIN_PEER_TIMEOUT_S,
        f"parallel.peer_timeout_s must be 0 (no watch) or >= {MIN_PEER_TIMEOUT_S:.0f} s, got {par.peer_timeout_s}: "
        f"shorter, a busy host's pause (swapping, a long garbage collection) could end a healthy run",
    )


def _check_model(cfg: RunConfig) -> None:
    _require(bool(cfg.model.hf_path), "model.hf_path is empty: name a Hugging Face model directory")
    config_json = Path(cfg.model.hf_path) / "config.json"
    _require(config_json.is_file(), f"model.hf_path: no config.json at {config_json}")
    _require(cfg.model.logprob_chunk_size >= 1, "model.logprob_chunk_size must be >= 1")
    _require(cfg.model.recompute_num_layers >= 1, "model.recompute_num_layers must be >= 1")
    _require(
        cfg.model.fp8 == "none" or cfg.model.dtype == "bfloat16",
        f"model.fp8={cfg.model.fp8} needs model.dtype=bfloat16, got {cfg.model.dtype}",
    )
    _require(
        not cfg.optimizer.cpu_offload or cfg.parallel.use_distributed_optimizer,
        "optimizer.cpu_offload needs parallel.use_distributed_optimizer=true",
    )
    _require(0.0 < cfg.optimizer.offload_fraction <= 1.0, "optimizer.offload_fraction must be in (0, 1]")


def _check_checkpoint(cfg: RunConfig) -> None:
    run_dir = run_dir_of(cfg)
    _require(not run_dir.exists() or run_dir.is_dir(), f"logging.run_dir: {run_dir} exists and is not a directory")
    _require(cfg.logging.lock_stale_after_s > 0, "logging.lock_stale_after_s must be > 0")
    _require(cfg.logging.samples_per_step >= 0, "logging.samples_per_step must be >= 0 (0: no samples)")
    ck = cfg.checkpoint
    _require(ck.save_interval >= 0, f"checkpoint.save_interval must be >= 0, got {ck.save_interval}")
    _require(ck.keep_last >= 1, f"checkpoint.keep_last must be >= 1, got {ck.keep_last}")
    _require(ck.sigterm_grace_s >= 0, f"checkpoint.sigterm_grace_s must be >= 0, got {ck.sigterm_grace_s}")
    _require(  # NaN compares False with every step time: the run stopped after every step with hours left
        math.isfinite(ck.time_limit_margin_s) and ck.time_limit_margin_s >= 0,
        f"checkpoint.time_limit_margin_s must be a number of seconds >= 0, got {ck.time_limit_margin_s}",
    )
    _require(ck.hf_export_interval >= 0, f"checkpoint.hf_export_interval must be >= 0, got {ck.hf_export_interval}")
    _require(bool(ck.resume), 'checkpoint.resume is empty: use "none", "auto", "force" or the path of a save')
    if ck.resume not in ("none", "auto", "force"):
        _require(Path(ck.resume).is_dir(), f"checkpoint.resume={ck.resume}: no such checkpoint directory")
    if cfg.model.init == "mcore":
        _require(bool(cfg.model.mcore_path), "model.init=mcore needs model.mcore_path (a converted checkpoint)")
        _require(Path(cfg.model.mcore_path).is_dir(), f"model.mcore_path={cfg.model.mcore_path}: no such directory")


def _check_algorithm(cfg: RunConfig) -> None:
    algo = cfg.algorithm
    _require(0.0 <= algo.clip_low < 1.0, f"algorithm.clip_low must be in [0, 1), got {algo.clip_low}")
    _require(algo.clip_high >= 0.0, f"algorithm.clip_high must be >= 0, got {algo.clip_high}")
    _require(
        algo.dual_clip_c is None or algo.dual_clip_c > 1.0,
        f"algorithm.dual_clip_c must be > 1 (or null), got {algo.dual_clip_c}",
    )
    _require(algo.loss_norm_len >= 0, "algorithm.loss_norm_len must be >= 0")
    _require(algo.entropy_coeff >= 0.0, "algorithm.entropy_coeff must be >= 0")
    _require(algo.advantage.eps > 0.0, f"algorithm.advantage.eps must be > 0, got {algo.advantage.eps}")
    _require(algo.kl.beta >= 0.0, f"algorithm.kl.beta must be >= 0, got {algo.kl.beta}")
    _check_reward(cfg)
    _check_length_shaping(cfg)
    _check_dynamic_sampling(cfg)
    _check_mismatch(cfg)
    _check_policy_loss(cfg)


def _check_reward(cfg: RunConfig) -> None:
    reward = cfg.algorithm.reward
    _require(reward.correct > reward.wrong, "algorithm.reward.correct must exceed algorithm.reward.wrong")
    _require(reward.timeout_s > 0.0, "algorithm.reward.timeout_s must be > 0")
    _require(
        math.isfinite(reward.correct_threshold) and (reward.graded or 0.0 < reward.correct_threshold <= 1.0),
        f"algorithm.reward.correct_threshold={reward.correct_threshold}: a verdict's number lies in [0, 1], so the "
        "threshold must be in (0, 1] (any finite value with algorithm.reward.graded=true)",
    )
    for source, spec in reward.verifiers.items():
        _require(bool(source) and bool(spec), f"algorithm.reward.verifiers: {source!r}: {spec!r} needs a data source "
                 "and a verifier")  # fmt: skip
    _require(
        reward.batch_timeout_s >= reward.timeout_s,
        f"algorithm.reward.batch_timeout_s ({reward.batch_timeout_s}) must be >= algorithm.reward.timeout_s "
        f"({reward.timeout_s}): a batch must have time for one check",
    )
    _require(reward.workers >= -1, "algorithm.reward.workers must be >= 0, or -1 (auto)")
    _require(reward.timeout_per_answer_s >= 0, "algorithm.reward.timeout_per_answer_s must be >= 0")


def _check_length_shaping(cfg: RunConfig) -> None:
    over, linear = cfg.algorithm.overlong, cfg.algorithm.length_penalty
    max_len = cfg.rollout.sampling.max_response_len
    if over.enabled:
        _require(
            0 < over.buffer_len < max_len,
            f"algorithm.overlong.buffer_len={over.buffer_len} must be in (0, rollout.sampling."
            f"max_response_len={max_len})",
        )
    if linear.enabled:
        _require(
            0 <= linear.safe_len < linear.max_len,
            f"algorithm.length_penalty: need 0 <= safe_len ({linear.safe_len}) < max_len ({linear.max_len})",
        )


def _check_dynamic_sampling(cfg: RunConfig) -> None:
    ds = cfg.algorithm.dynamic_sampling
    _require(
        not ds.filter or ":" in ds.filter,
        f"algorithm.dynamic_sampling.filter must be 'module:function', got {ds.filter!r}",
    )
    _require(
        1 <= ds.adaptive_min_prompts <= ds.adaptive_max_prompts,
        "algorithm.dynamic_sampling: need 1 <= adaptive_min_prompts <= adaptive_max_prompts",
    )


def _check_mismatch(cfg: RunConfig) -> None:
    mm = cfg.algorithm.mismatch
    _require(mm.tis_cap > 0.0, "algorithm.mismatch.tis_cap must be > 0")
    _require(mm.guard_max_kl > 0.0, "algorithm.mismatch.guard_max_kl must be > 0 (nats a token)")
    _require(0.0 <= mm.seq_mask_low < mm.seq_mask_high, "algorithm.mismatch: need 0 <= seq_mask_low < seq_mask_high")
    _require(
        0.0 <= mm.token_mask_low < mm.token_mask_high, "algorithm.mismatch: need 0 <= token_mask_low < token_mask_high"
    )
    _require(
        mm.early_stop_ratio is None or mm.early_stop_ratio > 0,
        "algorithm.mismatch.early_stop_ratio must be > 0 (or null)",
    )


def _check_policy_loss(cfg: RunConfig) -> None:
    algo = cfg.algorithm
    for name in ("gspo", "cispo"):
        section = getattr(algo, name)
        _require(section.clip_low >= 0.0 and section.clip_high >= 0.0, f"algorithm.{name}: clip_low / clip_high >= 0")
    _require(algo.sapo.tau_pos > 0.0 and algo.sapo.tau_neg > 0.0, "algorithm.sapo: tau_pos / tau_neg must be > 0")


def _check_rollout(cfg: RunConfig) -> None:
    par = cfg.parallel
    _require(
        par.generation_timeout_minutes >= par.timeout_minutes,
        f"parallel.generation_timeout_minutes={par.generation_timeout_minutes} must be >= parallel.timeout_minutes="
        f"{par.timeout_minutes}: replicas wait for each other's generation at least as long as for a collective",
    )
    ro = cfg.rollout
    _require(ro.n_samples_per_prompt >= 1, "rollout.n_samples_per_prompt must be >= 1")
    if cfg.algorithm.dynamic_sampling.enabled:
        _require(
            ro.n_samples_per_prompt >= 2,
            "rollout.n_samples_per_prompt=1 with dynamic sampling: every group would be dropped "
            "(a group of one has no reward spread); use >= 2 or algorithm.dynamic_sampling.enabled=false",
        )
    _require(ro.prompts_per_step >= 1, "rollout.prompts_per_step must be >= 1")
    _require(ro.gen_prompts_per_round >= 1, "rollout.gen_prompts_per_round must be >= 1")
    _require(ro.sampling.temperature > 0, "rollout.sampling.temperature must be > 0")
    _require(0 < ro.sampling.top_p <= 1, "rollout.sampling.top_p must be in (0, 1]")
    _require(ro.sampling.max_response_len >= 1, "rollout.sampling.max_response_len must be >= 1")
    _require(ro.engine_tp_size >= 1, "rollout.engine_tp_size must be >= 1")
    if ro.partial_rollout:
        _check_partial_rollout(cfg)
    _require(
        ro.engine_tp_size == 1 or ro.engine != "hf",
        "rollout.engine_tp_size > 1 needs rollout.engine=vllm or sglang (the hf engine has no tensor parallelism)",
    )
    _require(0 < ro.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization must be in (0, 1]")
    _require(ro.cpu_kv_cache_mb >= 1, "rollout.cpu_kv_cache_mb must be >= 1")
    _require(ro.max_num_batched_tokens >= 0, "rollout.max_num_batched_tokens must be >= 0 (0: engine default)")
    _require(ro.max_model_len >= 0, "rollout.max_model_len must be >= 0 (0: the model's limit)")
    _check_synthetic(cfg)


def _check_synthetic(cfg: RunConfig) -> None:
    """rollout.synthetic's knobs; rollout.engine=synthetic and algorithm.reward.verifier=synthetic go together (the
    engine's answers carry the verdicts that rule reads, and nothing else does); its log-probs are not the
    actor's, so the mismatch guard, which compares them, cannot stay on 'stop'."""
    syn, engine, verifier = cfg.rollout.synthetic, cfg.rollout.engine, cfg.algorithm.reward.verifier
    _require(
        syn.mean_len_first >= 1 and syn.mean_len_last >= 1,
        f"rollout.synthetic: mean_len_first ({syn.mean_len_first}) and mean_len_last ({syn.mean_len_last}) must be "
        ">= 1 token",
    )
    _require(
        cfg.trainer.rehearsal_micro_batches >= 0,
        f"trainer.rehearsal_micro_batches must be >= 0, got {cfg.trainer.rehearsal_micro_batches}",
    )
    _require(syn.length_sigma >= 0, f"rollout.synthetic.length_sigma must be >= 0, got {syn.length_sigma}")
    _require(0.0 <= syn.solve_rate <= 1.0, f"rollout.synthetic.solve_rate must be in [0, 1], got {syn.solve_rate}")
    _require(
        syn.solve_concentration > 0,
        f"rollout.synthetic.solve_concentration must be > 0, got {syn.solve_concentration}",
    )
    if engine == "synthetic":
        _require(
            verifier == "synthetic",
            f"rollout.engine=synthetic needs algorithm.reward.verifier=synthetic (its answers are drawn, not written: "
            f"the verdict drawn with each is what that rule reads), got {verifier!r}",
        )
        _require(
            cfg.algorithm.mismatch.guard != "stop",
            "rollout.engine=synthetic draws its log-probs instead of computing them: they are not the actor's, so "
            "the mismatch guard would stop the first step; set algorithm.mismatch.guard=off (or warn)",
        )
    else:
        _require(
            cfg.trainer.rehearsal_micro_batches == 0,
            "trainer.rehearsal_micro_batches leaves most of a step untrained: for rehearsals only "
            "(rollout.engine=synthetic)",
        )
        _require(
            verifier != "synthetic",
            f"algorithm.reward.verifier=synthetic reads the verdicts of rollout.engine=synthetic only (rehearsals and "
            f"tests): with rollout.engine={engine} every answer would be wrong",
        )


def _check_partial_rollout(cfg: RunConfig) -> None:
    ro = cfg.rollout
    _require(ro.partial_oversample >= 1, "rollout.partial_oversample must be >= 1")
    _require(ro.partial_max_staleness >= 0, "rollout.partial_max_staleness must be >= 0")
    _require(
        ro.engine_tp_size == 1 or ro.engine in ("vllm", "synthetic"),
        f"rollout.partial_rollout with rollout.engine={ro.engine} at rollout.engine_tp_size={ro.engine_tp_size}: only "
        "the vllm adapter (and the rehearsals' synthetic engine) stops an engine's TP ranks at one step "
        "(rollout/agreement.py); use engine_tp_size=1",
    )
    _require(
        cfg.algorithm.dynamic_sampling.mode == "resample",
        "rollout.partial_rollout needs algorithm.dynamic_sampling.mode=resample (a dynamic batch trains on "
        "whatever one round returns: there is nothing to stop early for)",
    )


def _check_batches(cfg: RunConfig) -> None:
    tr, par = cfg.trainer, cfg.parallel
    _require(tr.max_tokens_per_micro_batch >= 0, "trainer.max_tokens_per_micro_batch must be >= 0")
    _require(tr.packing in ("auto", "on", "off"), f"trainer.packing={tr.packing!r}; expected auto, on or off")
    _require(
        par.virtual_pipeline_model_parallel_size >= 1, "parallel.virtual_pipeline_model_parallel_size must be >= 1"
    )
    _require(
        not par.sequence_parallel or par.tensor_model_parallel_size > 1,
        "parallel.sequence_parallel needs parallel.tensor_model_parallel_size > 1",
    )
    _require(tr.steps >= 1, f"trainer.steps must be >= 1, got {tr.steps}")
    _require(tr.micro_batch_size >= 1, "trainer.micro_batch_size must be >= 1")
    _require(
        tr.mini_batch_size >= tr.micro_batch_size,
        f"trainer.mini_batch_size={tr.mini_batch_size} is smaller than trainer.micro_batch_size={tr.micro_batch_size}",
    )
    # lr 0 is a dry run: generation, scoring, the loss and saves all run, the weights stay as loaded
    _require(cfg.optimizer.lr >= 0, "optimizer.lr must be >= 0")
    _require(
        cfg.optimizer.min_lr <= cfg.optimizer.lr,
        f"optimizer.min_lr={cfg.optimizer.min_lr} is larger than optimizer.lr={cfg.optimizer.lr}",
    )
    _require(cfg.optimizer.warmup_steps >= 0, "optimizer.warmup_steps must be >= 0")


def run_dir_of(cfg: RunConfig) -> Path:
    """logging.run_dir, or runs/<name> when it is empty."""
    return Path(cfg.logging.run_dir or f"runs/{cfg.name}")


def checkpoint_dir_of(cfg: RunConfig) -> Path:
    """checkpoint.dir, or <run dir>/checkpoints when it is empty."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir_of(cfg) / "checkpoints"


# The rules trainer.eval_also_verifiers takes (rewards/answers.py: ALSO_RULES, which the config layer does not
# import; tests/unit/test_evaluate.py holds them equal).
EVAL_ALSO_RULES = ("dapo", "gsm8k")


def eval_file_list(text: str) -> list[str]:
    """data.eval_files (or another comma-separated key) as a list."""
    return [part.strip() for part in text.split(",") if part.strip()]


def _check_evaluation(cfg: RunConfig) -> None:
    tr, files = cfg.trainer, eval_file_list(cfg.data.eval_files)
    _require(tr.eval_interval >= 0, f"trainer.eval_interval must be >= 0, got {tr.eval_interval}")
    _require(
        tr.eval_interval == 0 or bool(files), "trainer.eval_interval > 0 needs data.eval_files (held-out .jsonl files)"
    )
    _require(tr.eval_k >= 1, f"trainer.eval_k must be >= 1, got {tr.eval_k}")
    _require(tr.eval_temperature >= 0, f"trainer.eval_temperature must be >= 0, got {tr.eval_temperature}")
    _require(0.0 < tr.eval_top_p <= 1.0, f"trainer.eval_top_p must be in (0, 1], got {tr.eval_top_p}")
    _require(tr.eval_max_response_len >= 0, "trainer.eval_max_response_len must be >= 0")
    for rule in eval_file_list(tr.eval_also_verifiers):
        _require(rule in EVAL_ALSO_RULES, f"trainer.eval_also_verifiers: {rule!r} is not one of {EVAL_ALSO_RULES}")
    for name in files:
        _require(name.endswith(".jsonl"), f"data.eval_files: {name} is not a .jsonl file")
        _require(Path(name).is_file(), f"data.eval_files: file not found: {name}")


def _check_data(cfg: RunConfig) -> None:
    data = cfg.data
    if data.source == "arithmetic":
        _require(data.min_operand <= data.max_operand, "data.min_operand must be <= data.max_operand")
        bad = set(data.ops) - set("+-*")
        _require(bool(data.ops) and not bad, f"data.ops must be made of '+', '-', '*', got {data.ops!r}")
        return
    path = Path(data.source)
    _require(path.suffix == ".jsonl", f"data.source must be 'arithmetic' or a .jsonl file, got {data.source}")
    _require(path.is_file(), f"data.source: file not found: {path}")


def _check_numbers(cfg: RunConfig) -> None:
    """No setting is NaN: it compares False with everything, so a bound written `x >= 0` let it through and a
    NaN margin, clip or rate then acted as neither small nor large."""
    nan = next((key for key, value in _settings(cfg) if isinstance(value, float) and math.isnan(value)), None)
    _require(nan is None, f"{nan}=nan: a setting must be a number")


def _settings(node, prefix: str = ""):
    """(dotted key, value) of every leaf setting of the config tree."""
    for f in fields(node):
        value = getattr(node, f.name)
        if is_dataclass(value):
            yield from _settings(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value


_SECTIONS = (
    _check_numbers,
    _check_parallel,
    _check_model,
    _check_algorithm,
    _check_rollout,
    _check_batches,
    _check_data,
    _check_evaluation,
    _check_checkpoint,
)
