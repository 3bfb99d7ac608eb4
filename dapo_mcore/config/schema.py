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
    # "hf": load the weights of hf_path; "random": Megatron's initialisation (tests, from-scratch runs).
    init: Literal["hf", "random"] = "hf"
    # Training precision of the actor's parameters and activations.
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    # "auto" picks Transformer Engine layers when transformer_engine imports, else Megatron's local layers.
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    # Initialisation seed for init="random".
    init_seed: int = 1234


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    # Megatron's distributed optimizer shards optimizer state over data-parallel ranks.
    use_distributed_optimizer: bool = True
    # "auto": CUDA with NCCL when a GPU is visible, else the CPU mode (gloo, fp32 only).
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Minutes a collective may wait before the process group gives up (catches hangs instead of sleeping).
    timeout_minutes: int = 30


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    # Maximum response length in tokens: L_max of the soft overlong punishment (paper: 20480).
    max_response_len: int = 20480


@dataclass
class RolloutConfig:
    # Engine adapter: "hf" (transformers, runs anywhere), "vllm", "sglang".
    engine: Literal["hf", "vllm", "sglang"] = "hf"
    # Responses sampled per prompt, G in the paper.
    n_samples_per_prompt: int = 16
    # Groups (prompts) in the training batch of one RL step, after dynamic sampling (paper: 512).
    prompts_per_step: int = 512
    # Prompts sent to the engines per generation round (paper's script: 3x prompts_per_step).
    gen_prompts_per_round: int = 1536
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # Weights go to the engines in buckets of about this many MiB (peers use ~512).
    weight_bucket_mb: int = 512
    # Rollout sampling seed; each (step, round, rank) derives its own stream from it.
    seed: int = 0


@dataclass
class OverlongConfig:
    # Soft overlong punishment (paper eq. 13): linear penalty in the last buffer_len tokens before L_max.
    enabled: bool = True
    # L_cache in the paper (4096 with L_max = 20480).
    buffer_len: int = 4096
    penalty_factor: float = 1.0
    # Overlong filtering: truncated responses get a zero loss mask (the paper's alternative).
    filter_truncated: bool = False


@dataclass
class DynamicSamplingConfig:
    # Keep only groups whose accuracy is strictly between 0 and 1 (paper eq. 11).
    enabled: bool = True
    # Generation rounds per step before the cap (paper's script: 10).
    max_rounds: int = 10
    # At the cap: "train" on the groups kept so far (warned, logged), or "error" out.
    on_cap: Literal["train", "error"] = "train"


@dataclass
class AlgorithmConfig:
    # Decoupled clip (clip-higher): ratio clipped to [1 - clip_low, 1 + clip_high].
    clip_low: float = 0.2
    clip_high: float = 0.28
    # Added to the group reward std in the advantage denominator.
    adv_eps: float = 1e-6
    # Reward for a correct / wrong final answer (paper: +1 / -1).
    reward_correct: float = 1.0
    reward_wrong: float = -1.0
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)


@dataclass
class OptimizerConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    # Linear warm-up over this many optimizer updates (paper: 20 rollout steps).
    warmup_steps: int = 20
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8


@dataclass
class TrainerConfig:
    # RL steps (rollout + update) to run.
    steps: int = 100
    # Responses per optimizer update (paper: 512 responses, so 16 updates per rollout step of 512 x 16).
    mini_batch_size: int = 512
    # Responses per forward/backward micro-batch on one data-parallel rank.
    micro_batch_size: int = 4
    # Seed of the torch RNG used by the actor (dropout, random init).
    seed: int = 42


@dataclass
class DataConfig:
    # "arithmetic" generates problems with exact answers; otherwise a .jsonl file of {prompt, answer}.
    source: str = "arithmetic"
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    # Shuffle seed; each epoch gets its own permutation.
    seed: int = 0
    # The arithmetic generator: operands drawn from [min_operand, max_operand].
    min_operand: int = 0
    max_operand: int = 29
    ops: str = "+"


@dataclass
class CheckpointConfig:
    dir: str = ""
    # Save every N RL steps (0: never).
    save_interval: int = 0


@dataclass
class WandbConfig:
    # "offline" writes under the run directory; "online" needs a login; "disabled" skips wandb.
    mode: Literal["offline", "online", "disabled"] = "offline"
    project: str = "dapo_mcore"


@dataclass
class LoggingConfig:
    # Run directory; empty means runs/<name>.
    run_dir: str = ""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # Progress bars while generating and training (rank 0 only).
    progress: bool = True
    # Redraw the accuracy / length plot every N steps (and at the end).
    plot_interval: int = 10


@dataclass
class RunConfig:
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
