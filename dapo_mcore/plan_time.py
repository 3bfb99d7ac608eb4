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

With optimizer.cpu_offload the Adam step runs on the host (mcore/cpu_adam.py: fused AdamW at the task's CPUs),
once per update (mini-batch) over a rank's offloaded parameters:

    CPU Adam a step = updates x host parameters a rank x max(one thread's time a parameter / threads,
                                                            ADAM_BYTES_PER_PARAM / (HOST_DRAM_BW / ranks a node))

threads scale it near-linearly until the node's ranks, stepping together, share out its memory bandwidth.
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
# Fused torch AdamW (fp32) on one thread, seconds a parameter: tools/bench_cpu_adam.py --params-m 50 --threads 1
# on a 2-core AMD EPYC (docs/benchmarks.md; 0.45-0.47 ns, unfused 4.5 ns). A server core with less memory
# bandwidth of its own is slower; the bandwidth floor below bounds what threads can win back.
CPU_ADAM_S_PER_PARAM = 0.47e-9
# What the fused step streams a parameter: reads parameter, gradient, exp_avg, exp_avg_sq; writes three (fp32).
ADAM_BYTES_PER_PARAM = 28
# Host memory bandwidth of an 8-GPU node, bytes/s, assumed (not measured): two sockets of 8 DDR5-4800 channels
# are 614 GB/s peak; a streaming kernel reaches about two thirds. Shared by the node's ranks.
HOST_DRAM_BW = 400e9
GPUS_PER_NODE = 8
DEFAULT_CPU_THREADS = 8  # slurm/train.sbatch's --cpus-per-task


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
    updates: int = 0  # optimizer updates a step (mini-batches)
    host_params: float = 0.0  # parameters whose Adam step a rank runs on the host (optimizer.cpu_offload)
    cpu_threads: int = DEFAULT_CPU_THREADS  # the task's CPUs, which that step uses


@dataclass(frozen=True)
class StepTime:
    shape: StepShape
    per_replica: float  # answers one replica generates a step
    at_once: float
    decode_step_s: float
    generation_s: float
    training_s: float
    cpu_adam_s: float = 0.0
    cpu_adam_s_per_param: float = 0.0

    @property
    def total_s(self) -> float:
        return self.generation_s + self.training_s + self.cpu_adam_s


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
    per_param = cpu_adam_s_per_param(shape.cpu_threads, min(shape.gpus, GPUS_PER_NODE))
    cpu_adam = shape.updates * shape.host_params * per_param
    return StepTime(shape, per_replica, at_once, decode_step, generation, training, cpu_adam, per_param)


def cpu_adam_s_per_param(threads: int, ranks_per_node: int) -> float:
    """A fused CPU AdamW's seconds a parameter at `threads`: one thread's time shared out, but no faster than
    the rank's share of the node's host memory bandwidth (every rank steps at once)."""
    return max(CPU_ADAM_S_PER_PARAM / max(threads, 1), _bandwidth_floor(ranks_per_node))


def _bandwidth_floor(ranks_per_node: int) -> float:
    return ADAM_BYTES_PER_PARAM * ranks_per_node / HOST_DRAM_BW


def format_step_time(step: StepTime) -> str:
    s = step.shape
    return (
        f"step time, estimated (not measured: mean answer {s.mean_len:,.0f} tokens, dynamic sampling keeping "
        f"{s.keep_rate:.0%} of groups, MFU {s.mfu:.0%}, HBM at {HBM_EFFICIENCY:.0%}; --mean-len, --keep-rate, "
        f"--mfu): generation {step.generation_s / 60:.0f} min (decode-bound: {step.per_replica:,.0f} answers a "
        f"replica, {step.at_once:,.0f} at once, {step.decode_step_s * 1e3:.0f} ms a decode step), training "
        f"{step.training_s / 60:.0f} min{_cpu_adam_part(step)}: about {_duration(step.total_s)} a step; give the "
        "job's --time at least a step, a save and the start-up (docs/gpu.md section 4)"
    ) + (f"\n{format_cpu_adam(step)}" if step.cpu_adam_s else "")


def _cpu_adam_part(step: StepTime) -> str:
    if not step.cpu_adam_s:
        return ""
    return f", CPU Adam {step.cpu_adam_s:.0f} s" if step.cpu_adam_s < 60 else f", CPU Adam {_duration(step.cpu_adam_s)}"


def format_cpu_adam(step: StepTime) -> str:
    s, ranks = step.shape, min(step.shape.gpus, GPUS_PER_NODE)
    threads = f"{s.cpu_threads} thread{'s' if s.cpu_threads != 1 else ''}"
    return (
        f"CPU Adam a step (optimizer.cpu_offload), estimated: {s.updates} updates x {s.host_params / 1e9:.2f}B "
        f"host params a rank x {step.cpu_adam_s_per_param * 1e9:.2f} ns a param = {step.cpu_adam_s:.0f} s; fused "
        f"AdamW at {threads} (--cpu-threads): {CPU_ADAM_S_PER_PARAM * 1e9:.2f} ns on one (tools/bench_cpu_adam.py) "
        f"/ {s.cpu_threads} = {CPU_ADAM_S_PER_PARAM / s.cpu_threads * 1e9:.2f} ns, floored at {ADAM_BYTES_PER_PARAM} "
        f"B a param / ({HOST_DRAM_BW / 1e9:.0f} GB/s of host memory, assumed, / {ranks} ranks a node) = "
        f"{_bandwidth_floor(ranks) * 1e9:.2f} ns; the PCIe copies of gradients and parameters "
        "are not counted"
    )


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{max(1, round(seconds / 60))} min"
