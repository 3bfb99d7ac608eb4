"""How long a step of a recipe takes, estimated from its shape before any GPU runs it (`dapo-mcore plan`).

Generation is decode-bound: each decode step of an engine replica reads its share of the weights and the KV of
the sequences it holds, once per token of every answer in flight, so a replica's round takes

    decode steps  = answers a replica generates x mean answer length / answers at once
    answers at once = min(its answers, KV cache tokens / (mean prompt + mean answer / 2))
    one decode step = (its weights + answers at once x their mean context x KV bytes a token) / HBM rate

with HBM at HBM_EFFICIENCY of its peak. Training is compute-bound: the kept answers' tokens x the FLOPs a token
costs (6 x active parameters for the update, 2 x for the old log-probs' forward, plus causal attention over the
mean context) / (GPUs x the GPU's dense bf16 peak x the MFU stated). Dynamic sampling generates 1 / keep rate
of the answers it keeps. Weight pushes, scoring and saves are left out (seconds against these minutes at the
recipes' shapes). An estimate, not a measurement: the inputs it assumes are printed with it.
"""

from __future__ import annotations

from dataclasses import dataclass

# Dense bf16 peak of an H100 / H200 SXM, FLOP/s; HBM bandwidth, bytes/s (H100 SXM 80 GB: 3.35 TB/s; H200 141 GB:
# 4.8 TB/s). A GPU of more than 96 GiB is taken for an H200.
BF16_PEAK = 989e12
HBM_H100, HBM_H200 = 3.35e12, 4.8e12
HBM_EFFICIENCY = 0.7  # what a decode step's reads reach of the peak (vLLM's decode kernels at large batch)
DEFAULT_MEAN_LEN = 8192  # the paper's answers late in a run (REFERENCE.md section 6); about 1k at the start
DEFAULT_KEEP_RATE = 0.5
DEFAULT_MFU = 0.35


@dataclass(frozen=True)
class StepShape:
    """The numbers of one step the estimate needs (dapo_mcore.plan computes them from the recipe)."""

    answers: int  # kept answers a step trains on: prompts_per_step x n
    mean_prompt: float
    mean_len: float  # mean answer length, in tokens
    keep_rate: float  # share of generated groups dynamic sampling keeps (1.0 without it)
    replicas: int
    kv_tokens: float  # one replica's KV cache, in tokens
    engine_weight_bytes: float  # one engine GPU's share of the weights
    kv_bytes_per_token: float  # one engine GPU's share of a token's K and V
    active_params: float  # parameters a token passes through (MoE: the top-k experts)
    layers: int
    attention_width: int  # query heads x head dim
    gpus: int
    gpu_gb: float
    mfu: float


@dataclass(frozen=True)
class StepTime:
    shape: StepShape
    per_replica: float  # answers one replica generates a step
    at_once: float
    decode_step_s: float
    generation_s: float
    training_s: float

    @property
    def total_s(self) -> float:
        return self.generation_s + self.training_s


def estimate(shape: StepShape) -> StepTime:
    per_replica = shape.answers / shape.keep_rate / shape.replicas
    context = shape.mean_prompt + shape.mean_len / 2  # a sequence's mean length while it decodes
    at_once = max(1.0, min(per_replica, shape.kv_tokens / (shape.mean_prompt + shape.mean_len)))
    hbm = (HBM_H200 if shape.gpu_gb > 96 else HBM_H100) * HBM_EFFICIENCY
    decode_step = (shape.engine_weight_bytes + at_once * context * shape.kv_bytes_per_token) / hbm
    generation = per_replica * shape.mean_len / at_once * decode_step
    tokens = shape.answers * (shape.mean_prompt + shape.mean_len)
    # per token: 2 FLOPs a parameter forward, x3 with backward, +1 forward for the old log-probs; causal attention
    # 2 x 2 x layers x width x context forward (QK^T and AV), the same multiples
    per_token = 8 * shape.active_params + 4 * 4 * shape.layers * shape.attention_width * context
    training = tokens * per_token / (shape.gpus * BF16_PEAK * shape.mfu)
    return StepTime(shape, per_replica, at_once, decode_step, generation, training)


def format_step_time(step: StepTime) -> str:
    s = step.shape
    return (
        f"step time, estimated (not measured: mean answer {s.mean_len:,.0f} tokens, dynamic sampling keeping "
        f"{s.keep_rate:.0%} of groups, MFU {s.mfu:.0%}, HBM at {HBM_EFFICIENCY:.0%}; --mean-len, --keep-rate, "
        f"--mfu): generation {step.generation_s / 60:.0f} min (decode-bound: {step.per_replica:,.0f} answers a "
        f"replica, {step.at_once:,.0f} at once, {step.decode_step_s * 1e3:.0f} ms a decode step), training "
        f"{step.training_s / 60:.0f} min: about {_duration(step.total_s)} a step; give the job's --time at least a "
        "step, a save and the start-up (docs/gpu.md section 4)"
    )


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{max(1, round(seconds / 60))} min"
