"""The one typed config tree of a dapo_mcore run.

Defaults are the DAPO paper's settings (arXiv 2503.14476, see docs/algorithm.md) wherever the paper gives
one; recipes in examples/ hold only their differences from these. Every leaf is a plain type so the
loader can check it, and leaf functions receive plain arguments, never these objects (DESIGN.md, rule 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ModelConfig:
    # A Hugging Face model directory: config.json (+ tokenizer files; + *.safetensors when init="hf").
    hf_path: str = ""
    # "hf": load the weights of hf_path; "mcore": load them from the Megatron-Core checkpoint at mcore_path
    # (tools/convert_hf_to_mcore.py output, or a run save); "random": Megatron's initialisation.
    init: Literal["hf", "mcore", "random"] = "hf"
    # With init=mcore: a checkpoint directory; its model must match hf_path's config.json.
    mcore_path: str = ""
    # Training precision of the actor's parameters and activations.
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    # "auto" picks Transformer Engine layers when transformer_engine imports, else Megatron's local layers.
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    # Initialisation seed for init="random".
    init_seed: int = 1234
    # Per-token log-probs and entropies straight from hidden states at response positions, a chunk of
    # tokens at a time: never [tokens x vocab] fp32 logits. false: full logits from Megatron's output layer.
    fused_logprobs: bool = True
    # Tokens per chunk of the fused computation (peak extra memory ~ 2 x chunk x vocab/TP x 4 bytes).
    logprob_chunk_size: int = 1024
    # With fused_logprobs, in training: the DAPO loss's per-token gradient is taken inside the fused head's
    # forward (its gradient depends only on each token's log-prob), so backward recomputes no logits: one
    # [tokens x hidden x vocab/TP] matmul less per step, for d hidden [tokens, hidden] and d W [vocab/TP,
    # hidden] kept from the loss's forward to its backward. false: recompute each chunk's logits in backward.
    fused_loss_grad: bool = True
    # FP8 matmuls through Transformer Engine (bf16 model, GPU): "e4m3" or "hybrid" (e5m2 gradients).
    fp8: Literal["none", "e4m3", "hybrid"] = "none"
    # Scaling recipe: "blockwise" (Hopper and newer; stable on DAPO in the peers' reports), "delayed",
    # "tensorwise" (current scaling; reported unstable on DAPO-17k), "mxfp8" (Blackwell only).
    fp8_recipe: Literal["delayed", "tensorwise", "blockwise", "mxfp8"] = "blockwise"
    # Keep the first and last transformer layer in bf16 when fp8 is on.
    fp8_first_last_layers_bf16: bool = False
    # Activation recompute: "selective" (core attention), "full" (whole layers), "none".
    recompute: Literal["none", "selective", "full"] = "none"
    # With recompute=full: layers per recomputed group (Megatron's uniform method).
    recompute_num_layers: int = 1
    # Mixture-of-experts models (config.json model_type qwen3_moe): the load-balancing loss coefficient
    # (Megatron's per-layer aux loss); negative: the model's own (config.json router_aux_loss_coef, 0.001 for
    # Qwen3-MoE); 0 turns it off.
    moe_aux_loss_coeff: float = -1.0
    # How tokens reach their experts' ranks: "alltoall" (Megatron's choice with expert parallelism) or
    # "allgather".
    moe_token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    # Routing replay (R3): "rollout" makes the actor's routers use the experts the engine chose for each
    # token, when computing the old log-probs and in the update; "off": their own. Either way, with an engine
    # that returns its routing (hf, sglang, vllm on a GPU), router/agreement logs the share of tokens whose
    # top-k experts the actor and the engine agree on (docs/moe.md).
    routing_replay: Literal["off", "rollout"] = "off"


@dataclass
class ParallelConfig:
    # Tensor parallelism of the actor (Megatron-Core): each layer's matrices split over this many GPUs of a node.
    tensor_model_parallel_size: int = 1
    # Pipeline parallelism of the actor: the layers split into this many stages.
    pipeline_model_parallel_size: int = 1
    # Model chunks per pipeline rank (interleaved 1F1B); 1 disables it. Layers must divide by PP x VPP.
    virtual_pipeline_model_parallel_size: int = 1
    # Split activations outside the TP regions along the sequence (needs TP > 1).
    sequence_parallel: bool = False
    # Context parallelism (CP) of the actor: each sequence split over this many ranks (Megatron's CP groups), for
    # answers whose activations do not fit one rank; CP ranks hold the same weights, so DP = world / (TP x PP x
    # CP). Rows are cut into 2 CP chunks (packed rows as THD, each sample's slot a multiple of 2 CP), the loss's
    # per-sequence sums taken over the CP ranks: the same loss and gradients as CP 1, for dense and
    # mixture-of-experts models (docs/design/context_parallel.md, docs/moe.md).
    context_parallel_size: int = 1
    # Mixture-of-experts models: experts split over this many ranks (expert parallelism, EP); the other
    # layers keep TP x PP x DP. EP x expert TP x PP must divide the world size, EP the number of experts.
    expert_model_parallel_size: int = 1
    # Tensor parallelism inside each expert; 0: the same as tensor_model_parallel_size (Megatron's default).
    expert_tensor_parallel_size: int = 0
    # Megatron's distributed optimizer shards optimizer state over data-parallel ranks.
    use_distributed_optimizer: bool = True
    # "auto": CUDA with NCCL when a GPU is visible, else the CPU mode (gloo, fp32 only).
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Minutes a collective may wait before the process group gives up (catches hangs instead of sleeping).
    timeout_minutes: int = 30
    # Minutes a replica that has finished generating (a round, or its share of the held-out sets) may wait
    # for the slowest one: a round of the paper's 20k-token answers can run far apart across replicas. Only
    # that meeting point waits so long (on a gloo group of its own); every other collective has timeout_minutes.
    generation_timeout_minutes: int = 240
    # The preflight's all-reduce across every rank must end within this many seconds (a broken fabric or
    # NCCL setting fails there, before the model is built).
    preflight_timeout_s: float = 300.0
    # Seconds a rank may go unheard (its node died: power, kernel panic, link down) before every other rank stops
    # with exit code 76 and one line naming it and its host, instead of waiting in a collective for
    # timeout_minutes; 0 disables the watch. It hears processes, not progress: a live but hung rank is left to
    # timeout_minutes.
    peer_timeout_s: float = 120.0

    def model_layout(self) -> tuple[int, int, int, int, int]:
        """(TP, PP, VPP, EP, expert TP): what the layout checks and the saves' records take (with
        context_parallel_size, passed apart as cp=)."""
        return (self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                self.virtual_pipeline_model_parallel_size, self.expert_model_parallel_size,
                self.expert_tensor_parallel_size)  # fmt: skip


@dataclass
class SamplingConfig:
    # Sampling temperature of the rollout engine (paper: 1.0); the actor divides its logits by it too.
    temperature: float = 1.0
    # Nucleus sampling of the rollout (paper: 1.0, the whole distribution).
    top_p: float = 1.0
    # Maximum response length in tokens: L_max of the soft overlong punishment (paper: 20480).
    max_response_len: int = 20480


@dataclass
class SyntheticEngineConfig:
    """rollout.engine=synthetic: answers drawn at once, without a model, for scale rehearsals and tests only,
    never for training a model (docs/engines.md). The defaults follow the DAPO paper's run (Qwen2.5-32B on
    DAPO-Math-17k): its mean response length grows from about 1k tokens to about 4-5k over the run
    (REFERENCE.md section 6), under the 20,480-token cap."""

    # The mean answer length in tokens (of the lognormal draw, before the rollout.sampling.max_response_len cap)
    # at the first step; it grows linearly to mean_len_last at trainer.steps.
    mean_len_first: float = 1000.0
    # The mean answer length (tokens, before the rollout.sampling.max_response_len cap) at the last step.
    mean_len_last: float = 4500.0
    # Spread of the lengths: sigma of their logarithm (0.8: about 1% of the answers reach the paper's 20,480 cap
    # at a 4.5k mean; larger: a longer tail, more truncated answers).
    length_sigma: float = 0.8
    # Truncated answers (cut at max_response_len, finish reason "length") are wrong, as a rule verifier finds
    # no final answer in them; false: their verdict is drawn like any other answer's.
    truncated_wrong: bool = True
    # The mean share of correct answers: each prompt gets its own solve probability, drawn from a Beta
    # distribution with this mean, and each answer is correct with it (needs algorithm.reward.verifier=synthetic).
    solve_rate: float = 0.5
    # The Beta's concentration (a + b): small values give many prompts solved always or never (all-correct and
    # all-wrong groups, which dynamic sampling drops); large ones, prompts near solve_rate (groups kept).
    solve_concentration: float = 1.0
    # Seed of the lengths, tokens, log-probs, routing and verdicts (rollout.seed seeds each request, as for
    # any engine): the same seeds and steps give the same answers.
    seed: int = 0


@dataclass
class RolloutConfig:
    # Engine adapter: "hf" (transformers, runs anywhere), "vllm", "sglang"; "synthetic": answers drawn without
    # a model, for scale rehearsals and tests only (rollout.synthetic; docs/engines.md).
    engine: Literal["hf", "vllm", "sglang", "synthetic"] = "hf"
    # Responses sampled per prompt, G in the paper.
    n_samples_per_prompt: int = 16
    # Groups (prompts) in the training batch of one RL step, after dynamic sampling (paper: 512).
    prompts_per_step: int = 512
    # Prompts sent to the engines per generation round (paper's script: 3x prompts_per_step). Without dynamic
    # sampling (nothing filtered) a synchronous round is what the step still needs, prompts_per_step at most.
    gen_prompts_per_round: int = 1536
    # Kept groups beyond prompts_per_step: false drops them, as the DAPO authors' code does (verl's
    # recipe/dapo trainer cuts the batch to train_batch_size x n); true trains them at the next step, which
    # wastes no generation but makes that step partly off-policy by one weight version (logged as
    # rollout/off_policy_frac; algorithm.mismatch.tis corrects against the engine's log-probs).
    carry_surplus: bool = False
    # Partial rollout (slime's --partial-rollout, APRIL arXiv 2509.18521; AReaL's interruptible generation): a
    # round stops as soon as the step has its kept groups instead of waiting for its longest answer; the
    # unfinished answers wait and are continued first at the next step, by the new weights (each token tagged
    # with the weights that generated it; algorithm.mismatch corrects against the engine's log-probs).
    # Use it with algorithm.mismatch.tis=token: so the demo's held-out accuracy is the synchronous sampler's,
    # without TIS it is lower (docs/partial_rollout.md); 1.7-2.3x the kept groups/s on a long-tail workload.
    # Off by default until it has run on a GPU engine (every figure so far is from the CPU).
    partial_rollout: bool = False
    # With partial rollout, prompts per round = gen_prompts_per_round x this: more answers in flight, so the
    # round can stop sooner.
    partial_oversample: float = 1.0
    # Unfinished groups begun more than this many weight versions ago are dropped (counted in
    # rollout/stale_dropped_answers): no trained token is older than this.
    partial_max_staleness: int = 1
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # Weights go to the engines in buckets of about this many MiB (peers use ~512).
    weight_bucket_mb: int = 512
    # After each push, check every bucket's checksum on the engine side against the actor's (costs one
    # extra pass over the weights); a mismatch stops the run naming the first tensor that differs, a pass logs
    # one line and weight_sync/verified_* metrics.
    verify_weights: bool = False
    # The same check on the run's first push only (a resume's too): a transfer path that is broken from the
    # start stops there; later pushes are watched by algorithm.mismatch.guard.
    verify_first_push: bool = True
    # Engine tensor-parallel size (vllm, sglang); may differ from the actor's TP. Engine replicas = world
    # size / engine_tp_size, each generating for its share of the prompts.
    engine_tp_size: int = 1
    # Fraction of GPU memory an engine may hold for weights + KV cache (vLLM gpu_memory_utilization,
    # SGLang mem_fraction_static); what the actor needs while generating must fit beside it.
    gpu_memory_utilization: float = 0.5
    # KV cache of an engine running on the CPU, in MiB.
    cpu_kv_cache_mb: int = 512
    # Tokens per engine forward pass (chunked prefill); 0: the engine's default.
    max_num_batched_tokens: int = 0
    # Longest prompt + response an engine accepts; 0: the model's max_position_embeddings.
    max_model_len: int = 0
    # Reuse the KV cache of shared prompt prefixes (the n answers of a prompt share it).
    enable_prefix_caching: bool = True
    # CUDA graphs for decoding (GPU only).
    cuda_graphs: bool = True
    # While the actor trains: 1 offloads the engine's weights to host memory and frees its KV cache;
    # 2 frees both (the next push refreshes the weights); 0 keeps everything on the GPU. GPU only.
    sleep_level: Literal[0, 1, 2] = 1
    # While the engine generates, free the actor's gradient buffers and move its optimizer moments to host
    # memory, so the engine's KV cache can use that GPU memory; restored before the update.
    offload_actor: bool = False
    # Rollout sampling seed; each (step, round, rank) derives its own stream from it.
    seed: int = 0
    # The synthetic engine's draws (rollout.engine=synthetic only).
    synthetic: SyntheticEngineConfig = field(default_factory=SyntheticEngineConfig)


@dataclass
class AdvantageConfig:
    # "grpo": (R - mean) / (std + eps) per group (the paper); "mean_only": R - mean (Dr.GRPO).
    estimator: Literal["grpo", "mean_only"] = "grpo"
    # Added to a group's reward std before dividing (grpo).
    eps: float = 1e-6
    # Then shift and scale the advantages to mean 0, std 1 over the whole batch.
    batch_normalize: bool = False


@dataclass
class RewardConfig:
    # "dapo" (final answer after "Answer:"), "math_verify" (symbolic, LaTeX/boxed), "gsm8k" (the final number),
    # "synthetic" (the verdicts rollout.engine=synthetic drew),
    # or "module:function": fn(response, reference), fn(response, reference, row), or verl's
    # compute_score(data_source, solution_str, ground_truth, extra_info) (docs/data.md, rewards/contract.py).
    verifier: str = "dapo"
    # Verifiers by the rows' data_source field: {source: verifier}; rows of other sources take `verifier`.
    verifiers: dict[str, str] = field(default_factory=dict)
    # Reward for a correct / wrong final answer (paper: +1 / -1; use 1 / 0 for a 0-1 reward).
    correct: float = 1.0
    # Reward for a wrong (or unparsable, or timed-out) answer.
    wrong: float = -1.0
    # true: a verifier's number (or a dict's "score") is the reward itself, before the length shaping (partial
    # credit, a format bonus); a bool still gives `correct` / `wrong`. false: a number in [0, 1] is a verdict.
    graded: bool = False
    # A number from this on counts as correct (accuracy, dynamic sampling's all-correct count, eval's avg@k).
    correct_threshold: float = 0.5
    # Each check runs in a worker process and counts as wrong past this many seconds.
    timeout_s: float = 10.0
    # One batch of checks (a round's answers on a rank) gets at most batch_timeout_s + timeout_per_answer_s x
    # answers / workers seconds: the checks not done by then count as timed out (wrong, and said in one warning),
    # so that a verifier that hangs costs a round this much, not timeout_s per answer in turn (a never-returning
    # verifier cost about 53 minutes a step of the demo), while a large round of slow checks still gets its time
    # (12,288 answers at the 7B recipe's round on 8 workers: 300 + 384 s).
    batch_timeout_s: float = 300.0
    # What each answer adds to its batch's budget (batch_timeout_s above), divided among the verifier workers.
    timeout_per_answer_s: float = 0.25
    # Verifier worker processes per rank: -1 (auto) starts one per 256 answers of a batch, up to the CPUs the
    # process may use less one (its node's CPUs shared by its GPU processes, or its own under CPU binding);
    # 0: in-process, no timeout (debugging only).
    workers: int = -1


@dataclass
class OverlongConfig:
    # Soft overlong punishment (paper eq. 13): linear penalty in the last buffer_len tokens before L_max.
    enabled: bool = True
    # L_cache in the paper (4096 with L_max = 20480).
    buffer_len: int = 4096
    # Scale of that penalty: -penalty_factor at L_max (paper: 1.0).
    penalty_factor: float = 1.0
    # Overlong filtering: truncated responses get a zero loss mask (the paper's alternative).
    filter_truncated: bool = False


@dataclass
class LengthPenaltyConfig:
    # RLinf's linear length penalty: -coef * (len - safe_len) / (max_len - safe_len), within [-1, 0].
    enabled: bool = False
    # Scale of the linear length penalty (-coef at max_len).
    coef: float = 1.0
    # Length in tokens up to which an answer is not penalised.
    safe_len: int = 16384
    # Length in tokens at which the penalty reaches -coef.
    max_len: int = 20480


@dataclass
class DynamicSamplingConfig:
    # Keep only groups whose verifier scores differ (0 < accuracy < 1, paper eq. 11).
    enabled: bool = True
    # "resample": generate rounds until prompts_per_step groups are kept (the paper);
    # "dynamic_batch": one round of prompts_per_step prompts, train on the groups kept (AReaL's dynamic_bs).
    mode: Literal["resample", "dynamic_batch"] = "resample"
    # Generation rounds per step before the cap (paper's script: 10); 0 or less: no cap.
    max_rounds: int = 10
    # At the cap: "train" on the groups kept so far (warned, logged), or "error" out.
    on_cap: Literal["train", "error"] = "train"
    # A custom keep/drop predicate, 'module:function' taking a data.types.Group; empty: the default filter.
    filter: str = ""
    # Size each round from a running keep-rate estimate instead of rollout.gen_prompts_per_round.
    adaptive: bool = False
    # Bounds of an adaptive round, in prompts.
    adaptive_min_prompts: int = 1
    # The largest adaptive round, in prompts.
    adaptive_max_prompts: int = 4096


@dataclass
class KLConfig:
    # KL penalty weight; 0 (the paper) builds and runs no reference model.
    beta: float = 0.0
    # "kl" (k1), "abs", "mse" (k2), "low_var_kl" (k3, clamped to [-10, 10]).
    estimator: Literal["kl", "abs", "mse", "low_var_kl"] = "low_var_kl"


@dataclass
class MismatchConfig:
    # Train/inference mismatch correction with importance weights exp(logp_old - logp_rollout):
    # "token": truncated importance sampling, weights capped at tis_cap; "sequence_mask": drop the tokens of
    # sequences whose geometric-mean weight leaves [seq_mask_low, seq_mask_high]; "none": metrics only.
    # "sequence": truncated importance sampling of whole sequences, each token weighted by its sequence's product
    # of weights, capped at tis_cap; "sequence_geometric": the same with the sequence's geometric-mean weight
    # (exp of the mean log weight over its tokens), which long responses do not drive to 0 or the cap;
    # "token_reject": verl's token rejection, the tokens whose weight leaves [token_mask_low, token_mask_high]
    # drop out (no gradient, out of the denominator); "icepop": IcePop as published (Ring-1T), each token
    # weighted by its weight inside [token_mask_low, token_mask_high], by 0 outside, all in the denominator.
    # Each composes with every algorithm.policy_loss. (The former "token_mask" is "token_reject".)
    tis: Literal["none", "token", "sequence", "sequence_geometric", "sequence_mask", "token_reject", "icepop"] = "none"
    # The cap of the importance weights (tis=token: each token's; tis=sequence: each sequence's product;
    # tis=sequence_geometric: each sequence's geometric mean).
    tis_cap: float = 2.0
    # tis=sequence_mask: the lowest sequence (geometric-mean) weight kept.
    seq_mask_low: float = 0.5
    # tis=sequence_mask: the highest sequence (geometric-mean) weight kept.
    seq_mask_high: float = 2.0
    # tis=token_reject / icepop: the lowest token weight kept (IcePop's alpha, Ring-1T: 0.5).
    token_mask_low: float = 0.5
    # tis=token_reject / icepop: the highest token weight kept (IcePop's beta, Ring-1T: 5).
    token_mask_high: float = 5.0
    # Skip (zero loss, no tokens counted) a micro-batch whose mean ratio exceeds this (RLinf's
    # early_stop_imp_ratio); null: never.
    early_stop_ratio: float | None = None
    # The guard against a broken weight push: when the engine's answers of the step's weights have a KL(engine
    # || actor) above guard_max_kl nats a token (mismatch/k3_kl, from the engine's and the actor's log-probs
    # of the same tokens; bf16 numerics give thousandths; swapped gate/up weights gave 1.4 on the demo),
    # "stop" the run with one line naming the step and the gap, "warn" and train on, or "off".
    guard: Literal["stop", "warn", "off"] = "stop"
    # The guard's threshold, in nats a token (bf16 numerics give thousandths; a wrong weight push, tenths or more).
    guard_max_kl: float = 0.1


@dataclass
class GspoConfig:
    # GSPO's clip range of the sequence ratio (its length-normalised geometric mean), far narrower than a token
    # ratio's: the paper's 3e-4 / 4e-4 (arXiv 2507.18071).
    clip_low: float = 3.0e-4
    # The upper side of GSPO's clip range.
    clip_high: float = 4.0e-4


@dataclass
class CispoConfig:
    # CISPO's importance weight is clipped to [1 - clip_low, 1 + clip_high] and detached (arXiv 2506.13585): the
    # paper bounds it above only, so clip_low 1 (a weight is never below 0); clip_high as in verl's CISPO example.
    clip_low: float = 1.0
    # The upper bound of CISPO's weight is 1 + clip_high.
    clip_high: float = 0.2


@dataclass
class SapoConfig:
    # SAPO's soft gate (4 / tau) sigmoid(tau (r - 1)) for tokens of positive advantage (arXiv 2511.20347: 1.0).
    tau_pos: float = 1.0
    # The gate's temperature for negative advantages, the steeper (the paper: 1.05).
    tau_neg: float = 1.05


# algorithm.loss_agg=auto for each policy loss whose paper aggregates otherwise than token-mean: SAPO (arXiv
# 2511.20347) and GSPO (arXiv 2507.18071, eq. 5) average each sequence's token terms, then the sequences, as verl's
# sapo and gspo do.
PAPERS_LOSS_AGG = {"sapo": "seq-mean-token-mean", "gspo": "seq-mean-token-mean"}


@dataclass
class AlgorithmConfig:
    # The policy loss: "dapo" (clip-higher PPO, the paper's), "gspo" (sequence-level ratio, arXiv 2507.18071),
    # "cispo" (clipped, detached importance weight times the log-prob, arXiv 2506.13585), "sapo" (soft gate,
    # arXiv 2511.20347). Their own settings are algorithm.gspo / cispo / sapo; clip_low / clip_high /
    # dual_clip_c are dapo's.
    policy_loss: Literal["dapo", "gspo", "cispo", "sapo"] = "dapo"
    # Decoupled clip (clip-higher): ratio clipped to [1 - clip_low, 1 + clip_high] (paper: 0.2 / 0.28).
    clip_low: float = 0.2
    # The upper clip, larger than the lower so that unlikely tokens can gain probability (paper: 0.28).
    clip_high: float = 0.28
    # Dual-clip bound c for negative advantages (the authors' script: 10); null disables it.
    dual_clip_c: float | None = 10.0
    # "token-mean" (the paper), "seq-mean-token-mean" (GRPO), "seq-mean-token-sum",
    # "seq-mean-token-sum-norm" (Dr.GRPO); every mode is over the whole mini-batch. "auto": the policy loss's
    # paper's (PAPERS_LOSS_AGG): seq-mean-token-mean for sapo and gspo, token-mean for the others.
    loss_agg: Literal["auto", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "auto"
    )
    # The constant divisor of seq-mean-token-sum-norm; 0: rollout.sampling.max_response_len.
    loss_norm_len: int = 0
    # Entropy bonus coefficient (the loss subtracts coef * entropy); 0: entropy is only a metric.
    entropy_coeff: float = 0.0
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    length_penalty: LengthPenaltyConfig = field(default_factory=LengthPenaltyConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    gspo: GspoConfig = field(default_factory=GspoConfig)
    cispo: CispoConfig = field(default_factory=CispoConfig)
    sapo: SapoConfig = field(default_factory=SapoConfig)


@dataclass
class OptimizerConfig:
    # Adam's learning rate after warm-up (paper: 1e-6, constant).
    lr: float = 1e-6
    # The learning rate's floor (a decay schedule ends there; 0 with the paper's constant rate).
    min_lr: float = 0.0
    # Linear warm-up over this many optimizer updates (paper: 20 rollout steps).
    warmup_steps: int = 20
    # Decoupled weight decay (AdamW; paper: 0.1).
    weight_decay: float = 0.1
    # Clip the global gradient norm to this (paper: 1.0).
    clip_grad: float = 1.0
    # Adam's first-moment decay.
    adam_beta1: float = 0.9
    # Adam's second-moment decay.
    adam_beta2: float = 0.999
    # Adam's denominator epsilon.
    adam_eps: float = 1e-8
    # Keep (a fraction of) the optimizer state and step on the CPU (needs the distributed optimizer, GPU).
    cpu_offload: bool = False
    # With cpu_offload: the share of the optimizer state kept on the CPU, in (0, 1].
    offload_fraction: float = 1.0


@dataclass
class TrainerConfig:
    # RL steps (rollout + update) to run.
    steps: int = 100
    # Responses per optimizer update (paper: 512 responses, so 16 updates per rollout step of 512 x 16).
    mini_batch_size: int = 512
    # Responses per forward/backward micro-batch on one data-parallel rank.
    micro_batch_size: int = 4
    # > 0: build micro-batches by a token budget (rows x padded length <= this) instead of micro_batch_size,
    # and balance data-parallel ranks by token count.
    max_tokens_per_micro_batch: int = 0
    # Pack several samples into each micro-batch row (positions restart per sample, attention stays inside
    # it), so long-tailed response lengths do not pad every row to the longest. Rows hold
    # max_tokens_per_micro_batch tokens (one row per micro-batch), or without a budget micro_batch_size rows
    # as long as the longest sample. "auto": on with the local layer spec (a block-diagonal causal mask, exact:
    # tests/dist), off with Transformer Engine, whose THD path (cu_seqlens) is written but not verified yet;
    # "on": packed on either (THD with Transformer Engine); "off": one padded length per mini-batch.
    # On long-tailed lengths packed rows ran 1.37x faster than padded ones on the 2-core CPU, and as fast on
    # the demo's short, similar lengths (docs/benchmarks.md).
    packing: str = "auto"
    # Seed of the torch RNG used by the actor (dropout, random init).
    seed: int = 42
    # Validate on data.eval_files before the first step, every N steps and after the last (0: never).
    eval_interval: int = 0
    # Answers per held-out problem and their sampling (the DAPO paper's AIME evaluation: avg@32 at
    # temperature 1.0, top-p 0.7); eval_max_response_len 0: rollout.sampling.max_response_len.
    eval_k: int = 32
    # Sampling temperature of the held-out answers.
    eval_temperature: float = 1.0
    # Nucleus sampling of the held-out answers (the paper's 0.7; an untrained small model may need 1.0).
    eval_top_p: float = 0.7
    # Longest held-out answer in tokens; 0: rollout.sampling.max_response_len.
    eval_max_response_len: int = 0
    # More rules the held-out answers are also checked by, comma-separated (dapo, gsm8k), beside
    # algorithm.reward.verifier: e.g. gsm8k (the reply's last number, lenient) beside dapo (the final answer after
    # "Answer:", strict). Their figures are eval/<file>:<rule>/<metric>; the same answers, no extra generation.
    eval_also_verifiers: str = ""
    # Rehearsals only (rollout.engine=synthetic, `dapo-mcore rehearse`): > 0 makes the actor compute (forward,
    # backward, optimizer step) only this many micro-batches of each step, those of its first mini-batch with the
    # shortest rows, cut to their first rows within 4096 tokens; every micro-batch is still built and held as in a
    # real step, the uncomputed rows take the engine's log-probs.
    # At the recipes' counts a rank holds millions of tokens, and the real vocabulary's head alone costs about 3 ms
    # a token on one CPU core. 0: every micro-batch (training).
    rehearsal_micro_batches: int = 0


@dataclass
class DataConfig:
    # "arithmetic" generates problems with exact answers; otherwise a .jsonl file of {prompt, answer}.
    source: str = "arithmetic"
    # The key of each row's problem text in the .jsonl file.
    prompt_key: str = "prompt"
    # The key of each row's ground-truth answer in the .jsonl file.
    answer_key: str = "answer"
    # Shuffle seed; each epoch gets its own permutation.
    seed: int = 0
    # A resume checks the data file against the save (its size, rows and a hash of them): a changed file is
    # refused, since the saved position would point at other prompts. true: continue with a warning, at the
    # same epoch and offset in the new file's order (an offset past its end starts the next epoch).
    allow_changed_data: bool = False
    # The arithmetic generator: operands drawn from [min_operand, max_operand].
    min_operand: int = 0
    # The largest operand of the arithmetic generator.
    max_operand: int = 29
    # The operators the arithmetic generator draws from, e.g. "+-*".
    ops: str = "+"
    # "chat": wrap each problem in the model's own chat template (chat / instruct models); "none": plain text.
    template: Literal["none", "chat"] = "none"
    # "dapo": the paper's instruction before and after each problem ("... Answer: $Answer ..."); "none": as is;
    # or your own text with {problem} where the problem goes.
    instruction: str = "none"
    # A system message for data.template=chat (empty: none).
    system_prompt: str = ""
    # Longest prompt in tokens (after the template and instruction); 0: the model's positions minus
    # rollout.sampling.max_response_len.
    max_prompt_len: int = 0
    # A prompt file's prompts longer than that: "error" (names file and row), "drop" them, or "truncate_left"
    # (keep their last max_prompt_len tokens); dropped / truncated ones are counted in the log.
    long_prompts: Literal["error", "drop", "truncate_left"] = "error"
    # Held-out prompt files (.jsonl, comma-separated) for validation every trainer.eval_interval steps; they
    # take the same template, instruction and verifier as training.
    eval_files: str = ""


@dataclass
class CheckpointConfig:
    # Where run checkpoints go (step_NNNNNN/ and a `latest` pointer); empty means <run_dir>/checkpoints.
    dir: str = ""
    # Save every N RL steps, and after the last step (0: never save).
    save_interval: int = 50
    # Keep the newest K complete saves; older ones are deleted after each save.
    keep_last: int = 2
    # "none": start fresh; "auto": continue from the newest complete save in `dir` (start fresh if there is
    # none), refusing a config that changes the experiment since that save; "force": the same, taking the
    # changes; or the path of one save (step_NNNNNN/) to continue from.
    resume: str = "none"
    # Write the shards in a background process while training goes on (Megatron-Core's async save); the
    # save is completed (manifest, `latest`) at a later step. Meant for GPUs, where a save otherwise blocks.
    async_save: bool = False
    # How a save stores the distributed optimizer's state. "dp_reshardable" (Megatron-LM's routine format): each
    # rank writes and reads only its own share, nothing is gathered; the save reloads at another data-parallel
    # size but not at another TP / PP / EP. "fully_reshardable": reloads at any layout, but each save gathers
    # every data-parallel group's whole optimizer state into its first rank's host memory, and each resume
    # reads the group's whole state on every rank (`dapo-mcore plan` prints both).
    optimizer_format: Literal["dp_reshardable", "fully_reshardable"] = "dp_reshardable"
    # Also write the model as HF safetensors (+ config, tokenizer) to <dir>/hf/step_NNNNNN every N saves.
    hf_export_interval: int = 0
    # On SIGUSR1 (Slurm's time-limit warning) or SIGTERM (preemption, scancel): finish the current step, save,
    # exit 75 so slurm/train.sbatch re-queues the job (false: stop at once, keeping earlier saves).
    save_on_signal: bool = True
    # After SIGTERM, how long the current step may take to reach its end (and the save); then the run stops
    # without saving. Keep it below Slurm's KillWait (30 s by default), after which Slurm kills the job.
    sigterm_grace_s: float = 20.0
    # Under Slurm, stop at a step boundary, save and exit 75 (re-queued by slurm/train.sbatch) when the longest
    # recent step plus a save would no longer end before the job's end time (whatever --signal says).
    stop_before_time_limit: bool = True
    # What that stop leaves free before the job's end time, in seconds: the run's shutdown, and a step that
    # runs longer than the longest recent one.
    time_limit_margin_s: float = 120.0


@dataclass
class WandbConfig:
    # "offline" writes under the run directory; "online" needs a login; "disabled" skips wandb.
    mode: Literal["offline", "online", "disabled"] = "offline"
    # The wandb project the run is logged under.
    project: str = "dapo_mcore"
    # The wandb team or user the run belongs to; empty: the login's default entity.
    entity: str = ""
    # Runs of one group are shown together in wandb (e.g. a sweep, or the jobs of one experiment); empty: none.
    group: str = ""
    # Labels to filter runs by in wandb, e.g. [7b, baseline].
    tags: list[str] = field(default_factory=list)


@dataclass
class LoggingConfig:
    # Run directory; empty means runs/<name>.
    run_dir: str = ""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # Progress bars while generating and training (rank 0 only).
    progress: bool = True
    # "quiet": the rollout engines (vLLM, SGLang) and wandb print errors only; "verbose": their own logging as
    # they configure it (vLLM's INFO lines, SGLang's, wandb's banners). VLLM_LOGGING_LEVEL, when set, wins.
    engine_log: Literal["quiet", "verbose"] = "quiet"
    # Draw curves.png in the run directory: every plot_interval steps and at the end. false: none (about 1 CPU-s
    # a drawing; `dapo-mcore plot RUN_DIR` draws it from metrics.jsonl at any time, during the run or after).
    plot: bool = True
    # Redraw the accuracy / length plot every N steps (and at the end).
    plot_interval: int = 10
    # Write N of each step's answers (prompt, answer, verdict, reward, advantage, weight versions) to
    # samples/step_K.jsonl and a wandb table, group by group, right and wrong in turn (docs/evaluation.md); 0: none.
    samples_per_step: int = 4
    # A run directory is locked while its run lives; a lock whose holder runs on another host and has not
    # refreshed it for this long (a job re-queued onto another node) is taken over. Same host: the pid is checked.
    lock_stale_after_s: int = 300


@dataclass
class RunConfig:
    # The run's name: runs/<name> unless logging.run_dir is set. From a recipe: its own `name:`, else the
    # file's stem (never inherited through defaults:).
    name: str = "dapo"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # Optional free-form note carried into the run directory.
    note: str | None = None
