"""Per-GPU memory plan of a run (`dapo-mcore plan`): plain arithmetic over the resolved config and the model's
config.json. It imports no torch, megatron, transformer_engine or engine package, so it runs on a laptop.

Legend: t TP, p PP, v VPP, d DP, e engine TP, B bytes per element of model.dtype, h hidden, q = heads x
head_dim, k = kv_heads x head_dim, f FFN width, a heads, s the padded length of a row, T tokens of a micro-batch.

Per GPU, on the heaviest pipeline stage:
- actor weights: the stage's parameters as Megatron-Core builds them (mcore/provider.py): the vocab-parallel
  embedding (vocab padded to a multiple of 128 t) on the first stage, the output layer on the last (its own
  copy there when tied embeddings meet PP > 1), L / p layers split over t, norms replicated; x B.
- gradients: Megatron DDP's main-grad buffer, fp32 (mcore/actor.py: grad_reduce_in_fp32=True), 4 B for every
  parameter of the stage, distributed optimizer or not.
- optimizer: an fp32 master copy (bf16 / fp16 only: an fp32 model's optimizer steps the parameters themselves)
  and Adam's exp_avg and exp_avg_sq, / d with the distributed optimizer; optimizer.cpu_offload keeps the
  fraction optimizer.offload_fraction of it in host memory.
- activations kept for backward, per token and layer, after Korthikanti et al. 2022 ("Reducing Activation
  Recomputation in Large Transformer Models", sec. 4: 34 + 5 a s / h bytes x h for GPT-3), redone for no
  dropout, RMSNorm, SwiGLU and GQA:
      Transformer Engine layers (fused norm + linear, flash attention, fused SwiGLU; the GPU default):
          B x (4h [/t with sequence parallelism] + (3q + 3k + 3f) / t)
      Megatron's local layers (the CPU mode; counted from what autograd saves, checked by tools/bench_memory.py):
          B x (6h [/t] + (4q + 5f + a s) / t)  -- unfused norms, K and V repeated to all heads, unfused SwiGLU,
          and the softmax output a s: the s^2 term exists only where attention is not fused.
  recompute=selective drops the a s term; recompute=full keeps B h [/t] per group of recompute_num_layers
  layers. The first stage of 1F1B holds min(p, micro-batches) micro-batches of its L / p layers; the
  interleaved schedule (p (v + 1) - 1) chunks of L / (p v) layers (Narayanan et al. 2021's 1 + (p-1)/(p v)).
- peak transient: the larger of the log-prob head's backward on the last stage (mcore/fused_logprobs.py:
  fp32 [chunk, V/t] buffers, its fp32 weight gradient [V/t, h], the response tokens' hidden states and their
  fp32 gradient; without model.fused_logprobs, [T, V/t] logits) and one layer's backward (its gradients
  B T (h + 3f/t), with recompute=full after its group is rebuilt).
- step batch: this rank's micro-batches of the whole step, on the device from the old log-probs to the end of
  the update (mcore/actor.py StepBatches): its 1/DP share of the step's answers at full length, 48 B a token
  (+ layers x top-k bytes of uint8 routing with routing replay). The trainer frees them and hands the
  allocator's cached blocks back to the driver after each update, before the weight push.
- engine: while generating, vLLM / SGLang take rollout.gpu_memory_utilization of the GPU for their weights
  (/ e), workspace and KV cache; asleep (sleep_level 1, 2) they keep a residue; the weight push wakes the
  weights beside the whole actor. They refuse to start unless their share is free: the engine starts before
  the actor allocates (build.py start_engine), so "engine start" compares the share with the GPU less the
  CUDA context.
- host (optimizer.cpu_offload): offload_fraction of the fp32 master, the Adam moments and pinned fp32 grads.

Host memory a node (GPUS_PER_NODE processes; what a job's --mem must cover), held for the whole run: the engine's
weights copied to the host at sleep_level 1 (vLLM's CuMemAllocator backs them up in pinned memory, and PyTorch's
pinned-memory cache keeps those blocks between sleeps), the optimizer state rollout.offload_actor moves there
while generating (a non-blocking copy to the CPU lands in pinned memory, cached alike), optimizer.cpu_offload's
state, each process's own (Python, torch, CUDA's host side, the libraries: assumed) and the verifier workers;
then at most one of a step's rollout data, a save's staging or a resume's reads at a time. The page cache
(checkpoint files, the weights read at start) is not counted.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from dapo_mcore.config import RunConfig, load_config, parse_override
from dapo_mcore.config.model_spec import read_config_json, read_model_spec
from dapo_mcore.plan_time import (
    DEFAULT_CPU_THREADS,
    DEFAULT_KEEP_RATE,
    DEFAULT_MEAN_LEN,
    DEFAULT_MFU,
    GPUS_PER_NODE,
    StepShape,
    StepTime,
    estimate,
    format_step_time,
)
from dapo_mcore.rewards.pool import ANSWERS_PER_WORKER
from dapo_mcore.utils.errors import ConfigError, LayoutError

GIB = 1 << 30
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Per GPU process: the CUDA context (~0.5 GiB on H100) and the NCCL communicators of the actor and the engine.
_CUDA_CONTEXT_GIB = 1.5
# The caching allocator's fragmentation, as a share of the memory that comes and goes with each micro-batch.
_ALLOCATOR_SLACK = 0.10
# What a sleeping vLLM / SGLang keeps (CUDA graph pools, sampler buffers): an assumption, not measured here.
_ENGINE_ASLEEP_GIB = 1.5
_CUDA_GRAPHS_GIB = 0.5
# The engine's own defaults when the config leaves them to it (vLLM's max_num_batched_tokens, max_num_seqs).
_ENGINE_BATCHED_TOKENS = 8192
_ENGINE_MAX_SEQS = 1024
_HF_ENGINE_ROWS = 256  # HFEngine's max_batch_rows
_MICRO_BATCH_BYTES_PER_TOKEN = 6 * 4 + 3 * 8  # MicroBatch: six float [b, s] tensors and three long ones
# Host memory of a GPU process beside what the lines count: Python, torch, CUDA's host side, Megatron-Core and the
# engine's libraries. An assumption, not measured here.
_PROCESS_HOST_GIB = 4.0
# A verifier worker (rewards/pool.py): 27 MB resident with the dapo rule, 89 MB with math_verify after a check
# (measured on the CPU); the rest is room for a verifier's caches.
_VERIFIER_WORKER_GIB = 0.25
# The data path's host memory a trained token of the rank's share (the answers, the built micro-batches, the
# exchange's buffer): the rehearsal's figure at an 8k mean answer (docs/rehearsal.md).
_DATA_BYTES_PER_TOKEN = 88
# A round's answers, which each rank of their replica holds until the keep decision: token ids (int64).
_ROUND_BYTES_PER_TOKEN = 8
# --mem: the peak plus this share for what the plan leaves out (the allocators' slack, the page cache it is
# charged for), rounded up to whole multiples of _MEM_STEP_GIB.
_MEM_MARGIN = 0.10
_MEM_STEP_GIB = 16

Kind = Literal["actor", "engine", "overhead"]


@dataclass(frozen=True)
class ModelShape:
    """The sizes the arithmetic below needs, from the ModelSpec every other part reads (one parser of
    config.json: dapo_mcore.config.model_spec)."""

    model_type: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    max_positions: int
    # Mixture of experts (0 experts: dense): experts of width moe_ffn, topk per token, in moe_layers layers.
    experts: int = 0
    topk: int = 0
    moe_ffn: int = 0
    moe_layers: int = 0
    moe_pattern: tuple[bool, ...] = ()  # layer i is sparse

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelShape:
        spec = read_model_spec(hf)
        return cls(
            model_type=spec.model_type,
            vocab=spec.vocab_size,
            hidden=spec.hidden_size,
            layers=spec.num_layers,
            heads=spec.num_heads,
            kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            ffn=spec.ffn_hidden_size,
            tied=spec.tie_word_embeddings,
            qkv_bias=spec.qkv_bias,
            qk_norm=spec.qk_norm,
            max_positions=spec.max_position_embeddings,
            experts=spec.num_experts,
            topk=spec.moe_topk,
            moe_ffn=spec.moe_ffn_hidden_size,
            moe_layers=spec.num_moe_layers,
            moe_pattern=spec.moe_layers,
        )

    def sparse_layers_of_stage(self, pp: int, pp_rank: int) -> int:
        per_stage = self.layers // pp
        return sum(self.moe_pattern[pp_rank * per_stage : (pp_rank + 1) * per_stage])

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def k(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    def attention_params(self, tp: int) -> float:
        """One layer's attention on one TP rank: QKV (+ bias) and output projection split over TP; the layer's
        norms (replicated)."""
        sharded = self.hidden * (self.q + 2 * self.k) + self.q * self.hidden
        bias = self.q + 2 * self.k if self.qkv_bias else 0
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return (sharded + bias) / tp + norms

    def layer_params(self, tp: int) -> float:
        """One dense layer on one TP rank: its attention and its SwiGLU MLP split over TP."""
        return self.attention_params(tp) + 3 * self.hidden * self.ffn / tp

    def expert_params(self, ep: int, etp: int) -> float:
        """One sparse layer's experts on one rank: experts / EP of them, each SwiGLU split over expert TP."""
        return self.experts / ep * 3 * self.hidden * self.moe_ffn / etp

    def moe_layer_params(self, tp: int, ep: int, etp: int) -> float:
        """One sparse layer on one rank: attention over TP, the router (replicated), its share of experts."""
        return self.attention_params(tp) + self.experts * self.hidden + self.expert_params(ep, etp)

    def mlp_width(self, tp: int, etp: int) -> float:
        """The MLP width one rank computes per token, averaged over the layers: a dense layer's FFN / TP; a
        sparse one's top-k experts / expert TP (each token runs through topk experts, on whichever rank)."""
        sparse = self.topk * self.moe_ffn / etp
        return (self.dense_layers * self.ffn / tp + self.moe_layers * sparse) / self.layers

    def vocab_rows(self, tp: int) -> int:
        """Embedding rows per TP rank: Megatron pads the vocab to a multiple of 128 x TP."""
        multiple = 128 * tp
        return -(-self.vocab // multiple) * multiple // tp

    def total_params(self) -> int:
        """The unsharded model as its HF checkpoint holds it (what an engine loads)."""
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        layers = self.dense_layers * self.layer_params(1) + self.moe_layers * self.moe_layer_params(1, 1, 1)
        return round(layers) + embeddings + self.hidden

    def kv_bytes_per_token(self, engine_tp: int, dtype_bytes: int) -> float:
        """K and V of every layer, KV heads split over the engine's TP (replicated where TP exceeds them)."""
        return 2 * self.layers * self.k / min(engine_tp, self.kv_heads) * dtype_bytes


@dataclass(frozen=True)
class Line:
    name: str
    bytes: float
    formula: str
    kind: Kind = "actor"


@dataclass(frozen=True)
class Phase:
    name: str
    lines: tuple[Line, ...]

    @property
    def total(self) -> float:
        return sum(line.bytes for line in self.lines)

    def bytes_of(self, name: str) -> float:
        return sum(line.bytes for line in self.lines if line.name == name)


@dataclass(frozen=True)
class KVCache:
    tokens: float  # one engine replica's KV cache, in tokens
    sequence: int  # the longest prompt + response the engine must hold (rollout.max_model_len)
    wanted: float  # tokens one generation round sends to each replica, every answer at full length


@dataclass(frozen=True)
class EngineStart:
    """vLLM (and SGLang) refuse to start unless their share of the GPU is free. The engine starts before the
    actor allocates anything (build.py start_engine): only the CUDA context is taken then."""

    free: float  # bytes free on the GPU when the engine starts
    asked: float  # rollout.gpu_memory_utilization x the GPU

    @property
    def fits(self) -> bool:
        return self.free >= self.asked


@dataclass(frozen=True)
class Suggestion:
    change: str
    saves: float  # bytes off the peak
    fits: bool


@dataclass(frozen=True)
class HostMemory:
    """Host memory of one node's GPU processes (bytes a node in every line): `held` for the whole run, and
    `passing`, of which one at a time comes on top (a step's rollout data, a save's staging, a resume's reads)."""

    processes: int  # GPU processes a node
    held: tuple[Line, ...]
    passing: tuple[Line, ...]

    @property
    def largest_passing(self) -> Line | None:
        return max(self.passing, key=lambda line: line.bytes, default=None)

    @property
    def peak(self) -> float:
        largest = self.largest_passing
        return sum(line.bytes for line in self.held) + (largest.bytes if largest is not None else 0.0)

    @property
    def mem_gib(self) -> int:
        """What to ask of Slurm (--mem, per node): the peak and a margin, in whole steps of _MEM_STEP_GIB."""
        return math.ceil(self.peak * (1 + _MEM_MARGIN) / (_MEM_STEP_GIB * GIB)) * _MEM_STEP_GIB


@dataclass(frozen=True)
class MemoryPlan:
    gpu_bytes: float
    gpus: int
    layout: str
    stage: str
    phases: tuple[Phase, ...]
    kv: KVCache | None
    notes: tuple[str, ...] = ()
    suggestions: tuple[Suggestion, ...] = ()
    engine_start: EngineStart | None = None
    # Host memory a GPU's process takes for what it keeps off the GPU (optimizer.cpu_offload).
    host_lines: tuple[Line, ...] = ()
    # Host memory a GPU's process takes while it saves a checkpoint, and while it resumes from one.
    save_lines: tuple[Line, ...] = ()
    step_time: StepTime | None = None  # on GPUs with a vLLM / SGLang engine
    host: HostMemory | None = None  # host memory a node (on GPUs)

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda phase: phase.total)

    @property
    def kv_fits(self) -> bool:
        return self.kv is None or self.kv.tokens >= self.kv.sequence

    @property
    def engine_starts(self) -> bool:
        return self.engine_start is None or self.engine_start.fits

    @property
    def fits(self) -> bool:
        return self.peak.total <= self.gpu_bytes and self.kv_fits and self.engine_starts

    def phase(self, name: str) -> Phase:
        return next(phase for phase in self.phases if phase.name == name)


@dataclass(frozen=True)
class _Layout:
    gpus: int
    tp: int
    pp: int
    vpp: int
    dp: int
    engine_tp: int
    on_gpu: bool
    fused: bool  # Transformer Engine layers (fused attention); Megatron's local spec otherwise
    ep: int = 1  # expert parallel
    etp: int = 1  # expert tensor parallel
    cp: int = 1  # context parallel: each sequence split over cp ranks (docs/design/context_parallel.md)

    @property
    def replicas(self) -> int:
        return self.gpus // self.engine_tp

    @property
    def expert_dp(self) -> int:
        """The ranks that hold the same experts: the distributed optimizer shards expert state over them."""
        return self.gpus // (self.ep * self.etp * self.pp)


@dataclass(frozen=True)
class _Tokens:
    sequence: int  # the longest prompt + response, padded as the actor pads it
    prompt: int  # the longest prompt
    micro_batch: int  # tokens of the largest micro-batch
    micro_batches: int  # per DP rank and mini-batch, every sample at full length
    response: int  # response tokens of the largest micro-batch: the rows of the log-prob head
    cp: int = 1  # a rank computes 1/cp of each micro-batch's tokens (context parallelism)

    @property
    def on_rank(self) -> int:
        """Tokens of the largest micro-batch that one rank computes."""
        return self.micro_batch // self.cp

    @property
    def response_on_rank(self) -> int:
        return self.response // self.cp


@dataclass(frozen=True)
class Assumed:
    """What the step-time estimate cannot read from the recipe (dapo_mcore.plan_time)."""

    mean_len: int = DEFAULT_MEAN_LEN
    keep_rate: float = DEFAULT_KEEP_RATE
    mfu: float = DEFAULT_MFU
    cpu_threads: int = DEFAULT_CPU_THREADS  # a task's CPUs, for the CPU Adam of optimizer.cpu_offload


def plan_memory(
    cfg: RunConfig, model_config: dict[str, Any], gpu_gb: float, gpus: int | None = None, assumed: Assumed = Assumed()
) -> MemoryPlan:
    """The per-GPU memory of `cfg` on `gpus` GPUs (default: default_gpus()) of `gpu_gb` GiB each, with what
    to change when it does not fit, and the step's time estimated."""
    gpus = gpus or default_gpus()
    plan = _plan(cfg, model_config, gpu_gb, gpus)
    shape = ModelShape.from_hf(model_config)
    plan = replace(
        plan,
        step_time=_step_time(cfg, shape, gpus, gpu_gb, plan, assumed),
        host=_host_memory(cfg, shape, _layout(cfg, shape, gpus), plan, assumed),
    )
    if plan.fits:
        return plan
    return replace(plan, suggestions=_suggestions(cfg, model_config, gpu_gb, gpus, plan))


def _step_time(
    cfg: RunConfig, shape: ModelShape, gpus: int, gpu_gb: float, plan: MemoryPlan, assumed: Assumed
) -> StepTime | None:
    lay = _layout(cfg, shape, gpus)
    if not lay.on_gpu or plan.kv is None:
        return None
    ro, b = cfg.rollout, _DTYPE_BYTES[cfg.model.dtype]
    inactive = shape.moe_layers * shape.expert_params(1, 1) * (1 - shape.topk / max(shape.experts, 1))
    keep = assumed.keep_rate if cfg.algorithm.dynamic_sampling.enabled else 1.0
    step = StepShape(
        answers=step_answers(cfg),
        mean_prompt=_tokens(cfg, shape, lay).prompt / 2,
        mean_len=min(assumed.mean_len, ro.sampling.max_response_len),
        keep_rate=keep,
        replicas=lay.replicas,
        kv_tokens=plan.kv.tokens,
        engine_weight_bytes=shape.total_params() * b / lay.engine_tp,
        kv_bytes_per_token=shape.kv_bytes_per_token(lay.engine_tp, b),
        active_params=shape.total_params() - inactive,
        layers=shape.layers,
        attention_width=shape.q,
        gpus=gpus,
        gpu_gb=gpu_gb,
        mfu=assumed.mfu,
        updates=-(-step_answers(cfg) // cfg.trainer.mini_batch_size),
        host_params=_host_params(cfg, shape, lay),
        cpu_threads=assumed.cpu_threads,
    )  # fmt: skip
    return estimate(step)


def step_answers(cfg: RunConfig) -> int:
    return cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt


def _host_params(cfg: RunConfig, shape: ModelShape, lay: _Layout) -> float:
    """Parameters whose Adam step a rank runs on the host: offload_fraction of its optimizer shard (the larger
    of the first and last pipeline stage's, as the memory plan takes the larger)."""
    if not cfg.optimizer.cpu_offload:
        return 0.0
    shard = max(_optimizer_shard(cfg, shape, lay, rank)[0] for rank in {0, lay.pp - 1})
    return shard * cfg.optimizer.offload_fraction


def default_gpus() -> int:
    """The job's task count under torchrun or Slurm, else one 8-GPU node."""
    for key in ("WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 8


def stage_params(cfg: RunConfig, model_config: dict[str, Any], pp_rank: int = 0, gpus: int | None = None) -> float:
    """Parameters one GPU of pipeline stage pp_rank holds: what the 'actor weights' line counts."""
    shape = ModelShape.from_hf(model_config)
    return _stage_params(shape, _layout(cfg, shape, gpus or default_gpus()), pp_rank)[0]


def _plan(cfg: RunConfig, hf: dict[str, Any], gpu_gb: float, gpus: int) -> MemoryPlan:
    shape = ModelShape.from_hf(hf)
    lay = _layout(cfg, shape, gpus)
    tokens = _tokens(cfg, shape, lay)
    stages = [_plan_stage(cfg, shape, lay, tokens, gpu_gb, rank) for rank in sorted({0, lay.pp - 1})]
    return max(stages, key=lambda plan: plan.peak.total)


def _layout(cfg: RunConfig, shape: ModelShape, gpus: int) -> _Layout:
    par, etp = cfg.parallel, cfg.rollout.engine_tp_size
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    vpp = par.virtual_pipeline_model_parallel_size
    ep, expert_tp = par.expert_model_parallel_size, par.expert_tensor_parallel_size or tp
    moe_checks = (
        (
            ("experts", shape.experts, ep),
            ("expert FFN width", shape.moe_ffn, expert_tp),
            ("GPUs", gpus, ep * expert_tp * pp),
        )
        if shape.experts
        else ()
    )
    for what, count, size in (
        *moe_checks,
        ("attention heads", shape.heads, tp),
        ("key/value heads", shape.kv_heads, tp),
        ("FFN width", shape.ffn, tp),
        ("layers", shape.layers, pp * vpp),
        ("GPUs", gpus, tp * pp * par.context_parallel_size),
        ("GPUs", gpus, etp),
        ("attention heads", shape.heads, etp),
    ):
        if count % size:
            cp = f", CP {par.context_parallel_size}" if par.context_parallel_size > 1 else ""
            raise LayoutError(
                f"the {count} {what} do not split {size} ways (TP {tp}, PP {pp}, VPP {vpp}{cp}, engine TP {etp}, "
                f"{gpus} GPUs)"
            )
    on_gpu = par.device != "cpu"  # "auto" plans for the GPUs a recipe is meant for
    impl = cfg.model.transformer_impl
    fused = impl == "transformer_engine" or (impl == "auto" and on_gpu)
    cp = par.context_parallel_size
    return _Layout(gpus, tp, pp, vpp, gpus // (tp * pp * cp), etp, on_gpu, fused, ep, expert_tp, cp)


def _tokens(cfg: RunConfig, shape: ModelShape, lay: _Layout) -> _Tokens:
    response = cfg.rollout.sampling.max_response_len
    prompt = cfg.data.max_prompt_len or max(shape.max_positions - response, 1)
    tp_sp = lay.tp if cfg.parallel.sequence_parallel else 1
    multiple = math.lcm(8, 2 * lay.cp * tp_sp) if lay.cp > 1 else math.lcm(8, tp_sp)  # the actor's padding
    sequence = -(-(prompt + response) // multiple) * multiple
    budget = cfg.trainer.max_tokens_per_micro_batch
    # A token budget packs rows up to it; a sample longer than the budget gets a micro-batch of its own.
    rows = max(1, budget // sequence) if budget else cfg.trainer.micro_batch_size
    micro_batch = max(budget, sequence) if budget else rows * sequence
    per_rank = -(-cfg.trainer.mini_batch_size // lay.dp)
    response_tokens = round(micro_batch * response / sequence)
    return _Tokens(sequence, prompt, micro_batch, -(-per_rank // rows), response_tokens, lay.cp)


def _plan_stage(
    cfg: RunConfig, shape: ModelShape, lay: _Layout, tokens: _Tokens, gpu_gb: float, pp_rank: int
) -> MemoryPlan:
    state = _actor_state_lines(cfg, shape, lay, pp_rank)
    transient = _activation_lines(cfg, shape, lay, tokens, pp_rank)
    engine = _EngineModel(cfg, shape, lay, tokens, gpu_gb)
    overhead = _overhead_lines(lay, sum(line.bytes for line in transient))
    # The update's activations and the step's micro-batches are freed and handed back to the driver after each
    # update (trainer.py release_cached_blocks), before the push wakes the engine's weights: PyTorch's cache
    # would otherwise keep them from the engine, whose pool (vLLM's CuMemAllocator) allocates beside it.
    phases = (
        Phase("generate", (*_resident_while_generating(cfg, state), *engine.awake(), *overhead)),
        Phase("train", (*state.values(), *transient, *engine.asleep(), *overhead)),
    )
    if lay.on_gpu and engine.sharded:
        phases += (Phase("weight push", (*state.values(), *engine.receiving(), *overhead)),)
    return MemoryPlan(
        gpu_bytes=gpu_gb * GIB,
        gpus=lay.gpus,
        layout=_describe_layout(cfg, shape, lay, tokens),
        stage="the only stage" if lay.pp == 1 else ("first stage" if pp_rank == 0 else "last stage"),
        phases=phases,
        kv=engine.kv_cache(),
        notes=_notes(cfg, lay, tokens) + _cp_note(cfg, shape, lay, tokens, pp_rank),
        engine_start=engine.start(),
        host_lines=_host_lines(cfg, shape, lay, pp_rank),
        save_lines=_save_lines(cfg, shape, lay, pp_rank),
    )


# --- the actor ------------------------------------------------------------------------------------------------


def _stage_expert_params(shape: ModelShape, lay: _Layout, pp_rank: int) -> float:
    """The experts' share of _stage_params."""
    return shape.sparse_layers_of_stage(lay.pp, pp_rank) * shape.expert_params(lay.ep, lay.etp)


def _stage_params(shape: ModelShape, lay: _Layout, pp_rank: int) -> tuple[float, str]:
    """Parameters on one TP rank of pipeline stage pp_rank, and what they are made of."""
    first, last = pp_rank == 0, pp_rank == lay.pp - 1
    layers, per_layer = shape.layers // lay.pp, shape.layer_params(lay.tp)
    embedding = shape.vocab_rows(lay.tp) * shape.hidden
    params, parts = layers * per_layer, [f"{layers} layers x {_count(per_layer)}"]
    if shape.experts:
        sparse = shape.sparse_layers_of_stage(lay.pp, pp_rank)
        dense = layers - sparse
        per_sparse = shape.moe_layer_params(lay.tp, lay.ep, lay.etp)
        params = dense * per_layer + sparse * per_sparse
        parts = [
            f"{sparse:g} sparse layers x {_count(per_sparse)} ({shape.experts // lay.ep} experts / expert TP {lay.etp})"
        ]
        parts += [f"{dense:g} dense layers x {_count(per_layer)}"] if dense else []
    if first:
        params, parts = params + embedding, [*parts, f"embedding {_count(embedding)}"]
    if last and (not shape.tied or lay.pp > 1):  # tied + PP > 1: the last stage keeps a copy for its head
        params, parts = params + embedding, [*parts, f"output layer {_count(embedding)}"]
    if last:
        params += shape.hidden  # the final norm
    return params, " + ".join(parts)


def _actor_state_lines(cfg: RunConfig, shape: ModelShape, lay: _Layout, pp_rank: int) -> dict[str, Line]:
    b, opt = _DTYPE_BYTES[cfg.model.dtype], cfg.optimizer
    params, parts = _stage_params(shape, lay, pp_rank)
    p = f"{_count(params)} params"
    on_gpu = 1.0 - (opt.offload_fraction if opt.cpu_offload else 0.0)
    master = 4 if b != 4 else 0
    sharded, shard = _optimizer_shard(cfg, shape, lay, pp_rank)
    if opt.cpu_offload:
        shard += f" x {on_gpu:g} left on the GPU (optimizer.cpu_offload)"
    return {
        "weights": Line("actor weights", params * b, f"{p} ({parts}; TP {lay.tp}) x {b} B"),
        "grads": Line("actor gradients", params * 4, f"{p} x 4 B (DDP main grads, fp32)"),
        "master": Line("actor fp32 master", sharded * master * on_gpu, f"{p} x {master} B {shard}"),
        "moments": Line("actor Adam moments", sharded * 8 * on_gpu, f"{p} x 8 B {shard}"),
    }


def _host_lines(cfg: RunConfig, shape: ModelShape, lay: _Layout, pp_rank: int) -> tuple[Line, ...]:
    """optimizer.cpu_offload: Megatron's HybridDeviceOptimizer (through its precision-aware path, so no fp32
    master copy stays on the GPU: mcore/actor.py) keeps offload_fraction of the fp32 master parameters and Adam
    moments in host memory, with pinned fp32 copies of their gradients to step them there."""
    opt = cfg.optimizer
    if not opt.cpu_offload or not lay.on_gpu:
        return ()
    sharded, shard = _optimizer_shard(cfg, shape, lay, pp_rank)
    f, p = opt.offload_fraction, f"{_count(sharded)} params {shard}"
    return (
        Line("fp32 master (host)", sharded * 4 * f, f"{p} x 4 B x offload_fraction {f:g}", "actor"),
        Line("Adam moments (host)", sharded * 8 * f, f"{p} x 8 B x {f:g}", "actor"),
        Line("fp32 gradients, pinned (host)", sharded * 4 * f, f"{p} x 4 B x {f:g}", "actor"),
    )


def _save_lines(cfg: RunConfig, shape: ModelShape, lay: _Layout, pp_rank: int) -> tuple[Line, ...]:
    """A save copies what the rank writes to host memory (Megatron's torch_dist writer; an async save stages it
    all at once): its optimizer share (fp32 master + Adam moments, 12 B a parameter) and the weights it writes
    (a fully parallel save: each weight the DP ranks share is written by one of them, about 1 / DP of the weights
    a rank). checkpoint.optimizer_format=fully_reshardable also gathers
    the DP group's whole optimizer state on the group's first rank (gloo: host memory), and every rank of the
    group reads that whole state back at a resume."""
    if cfg.checkpoint.save_interval <= 0:
        return ()
    params, _ = _stage_params(shape, lay, pp_rank)
    sharded, shard = _optimizer_shard(cfg, shape, lay, pp_rank)
    b, p = _DTYPE_BYTES[cfg.model.dtype], f"{_count(params)} params"
    own = Line("save: the rank's optimizer share", sharded * 12, f"{_count(sharded)} params {shard} x 12 B")
    # fully parallel save and load: each weight the ranks share is written, and read (then broadcast), by one
    written, split = _one_copy_share(shape, lay, pp_rank)
    weights = Line("save: the weights it writes", written * b, f"{_count(written)} params {split} x {b} B")
    read_weights = Line("resume: the weights it reads", written * b, f"{_count(written)} params {split} x {b} B")
    if cfg.checkpoint.optimizer_format == "dp_reshardable":
        read = Line("resume: the rank's optimizer share", sharded * 12, "read into place (a tensor at a time)")
        return own, weights, read, read_weights
    gathered = Line("save: the DP group's gathered state", params * 12, f"{p} x 12 B (fully_reshardable)")
    read = Line("resume: the DP group's whole state", params * 12, f"{p} x 12 B, on every rank (fully_reshardable)")
    return own, weights, gathered, read, read_weights


def _optimizer_shard(cfg: RunConfig, shape: ModelShape, lay: _Layout, pp_rank: int) -> tuple[float, str]:
    """Parameters whose optimizer state one GPU holds: the distributed optimizer shards the dense ones over DP,
    the experts' over the ranks that hold the same experts."""
    if cfg.parallel.use_distributed_optimizer:
        return _one_copy_share(shape, lay, pp_rank)
    params, _ = _stage_params(shape, lay, pp_rank)
    return params, "/ DP 1"


def _one_copy_share(shape: ModelShape, lay: _Layout, pp_rank: int) -> tuple[float, str]:
    """A rank's share of one copy of its stage's parameters: the dense ones split over DP, the experts over the
    ranks that hold the same experts (the distributed optimizer's shard, and what a fully parallel save writes)."""
    params, _ = _stage_params(shape, lay, pp_rank)
    experts = _stage_expert_params(shape, lay, pp_rank)
    dp, over = lay.dp * lay.cp, f"DP {lay.dp}" + (f" x CP {lay.cp}" if lay.cp > 1 else "")  # sharded over dp_cp
    if not experts:
        return params / dp, f"/ {over}"
    return (params - experts) / dp + experts / lay.expert_dp, (
        f"({_count(params - experts)} / {over} + experts {_count(experts)} / expert DP {lay.expert_dp})"
    )


def _resident_while_generating(cfg: RunConfig, state: dict[str, Line]) -> tuple[Line, ...]:
    """rollout.offload_actor frees the grad buffers and moves the optimizer state (Adam moments, the fp32 master
    copy of a bf16 / fp16 model) to the host while the engine generates (MegatronActor.offload_for_rollout);
    the weights stay."""
    if not cfg.rollout.offload_actor:
        return tuple(state.values())
    grads = Line("actor gradients", 0.0, "freed while generating (rollout.offload_actor)")
    if cfg.optimizer.cpu_offload:  # Megatron's hybrid optimizer keeps its GPU share there (offload skips it)
        return state["weights"], grads, state["master"], state["moments"]
    master = state["master"]
    if master.bytes > 0:
        master = Line(master.name, 0.0, "in host memory while generating (rollout.offload_actor)", master.kind)
    return (
        state["weights"],
        grads,
        master,
        Line("actor Adam moments", 0.0, "in host memory while generating (rollout.offload_actor)"),
    )


def _layer_bytes_per_token(cfg: RunConfig, shape: ModelShape, lay: _Layout, row: int) -> tuple[float, float]:
    """(bytes per token one layer keeps for backward without recompute, of which the attention scores)."""
    b, t = _DTYPE_BYTES[cfg.model.dtype], lay.tp
    sp = t if cfg.parallel.sequence_parallel else 1
    h, q, k = shape.hidden, shape.q, shape.k
    f_t = shape.mlp_width(t, lay.etp)  # FFN / TP; a sparse layer's top-k experts / expert TP
    # a sparse layer also keeps its tokens permuted to their experts and back: top-k copies of h each way
    dispatch = 2 * shape.topk * h * shape.moe_layers / shape.layers
    if lay.fused:  # V stays a view of the fused QKV output, so that whole buffer lives beside the roped Q and K
        return b * (4 * h / sp + (3 * q + 3 * k) / t + 3 * f_t + dispatch), 0.0
    scores = b * shape.heads * row / t  # the softmax output [b a, s, s]
    return b * (6 * h / sp + 4 * q / t + 5 * f_t + dispatch) + scores, scores


def _in_flight_layers(shape: ModelShape, lay: _Layout, tokens: _Tokens, pp_rank: int) -> float:
    """Layer-micro-batches whose activations stage pp_rank holds at the peak of the 1F1B schedule."""
    p, v = lay.pp, lay.vpp
    if v == 1:
        return min(p - pp_rank, tokens.micro_batches) * shape.layers / p
    chunks = min((p - pp_rank - 1) * 2 + (v - 1) * p + 1, tokens.micro_batches * v)  # Megatron's warm-up + 1
    return chunks * shape.layers / (p * v)


def _activation_lines(cfg: RunConfig, shape: ModelShape, lay: _Layout, tokens: _Tokens, pp_rank: int) -> list[Line]:
    b, T = _DTYPE_BYTES[cfg.model.dtype], tokens.on_rank
    full, scores = _layer_bytes_per_token(cfg, shape, lay, tokens.sequence)
    held = _in_flight_layers(shape, lay, tokens, pp_rank)
    mode, group = cfg.model.recompute, cfg.model.recompute_num_layers
    if mode == "full":
        sp = lay.tp if cfg.parallel.sequence_parallel else 1
        kept, unit = b * shape.hidden / sp / group, "B (each group's input, recompute=full)"
    else:
        kept, unit = full - (scores if mode == "selective" else 0.0), f"B/token/layer (recompute={mode})"
    lines = [
        Line("actor activations", held * kept * T, f"{held:g} layer-micro-batches x {T} tokens x {kept:.0f} {unit}")
    ]
    if scores:  # Megatron's local attention computes the scores into a persistent buffer (global memory buffer)
        lines.append(Line("attention score buffer", scores * T, f"{T} tokens x {scores:.0f} B (a s, local layers)"))
    lines.append(_peak_transient(cfg, shape, lay, tokens, pp_rank, full))
    if lay.cp > 1:  # one layer at a time: the whole sequence's K and V, and in backward their full gradients
        kv = 2 * tokens.sequence * shape.k / lay.tp * b
        lines.append(Line("K/V all-gather (context parallel)", 2 * kv, f"K, V and dK, dV of {tokens.sequence} "
                          f"tokens x {shape.k} / TP x {b} B, one layer at a time"))  # fmt: skip
    lines.append(_step_batch_line(cfg, shape, lay, tokens))
    return lines


def _step_batch_line(cfg: RunConfig, shape: ModelShape, lay: _Layout, tokens: _Tokens) -> Line:
    """This rank's micro-batches of the whole step, built once on the device for the old log-probs and the
    update (mcore/actor.py StepBatches) and released before the weight push (trainer.py train_phase): its
    1/DP share of the step's answers, each planned at full length, with their routing under routing replay."""
    ro = cfg.rollout
    samples = -(-ro.prompts_per_step * ro.n_samples_per_prompt // lay.dp)
    routing = shape.layers * shape.topk if shape.experts and cfg.model.routing_replay == "rollout" else 0
    per_token = _MICRO_BATCH_BYTES_PER_TOKEN + routing
    routed = f" + routing {shape.layers} layers x top-{shape.topk} uint8" if routing else ""
    held = tokens.sequence // lay.cp  # each answer's 1/CP share (context parallelism)
    share = f" / CP {lay.cp}" if lay.cp > 1 else ""
    formula = f"{samples} answers (the step's / DP {lay.dp}) x {tokens.sequence}{share} tokens x (48 B{routed})"
    return Line("step batch (micro-batch tensors)", samples * held * per_token, formula)


def _peak_transient(
    cfg: RunConfig, shape: ModelShape, lay: _Layout, tokens: _Tokens, pp_rank: int, full: float
) -> Line:
    """The larger of one layer's backward (its gradients; with recompute=full, its group rebuilt first) and, on
    the last stage, the log-prob head's backward, which runs before any layer's."""
    b, T, group = _DTYPE_BYTES[cfg.model.dtype], tokens.on_rank, cfg.model.recompute_num_layers
    rebuilt = group * full * T if cfg.model.recompute == "full" else 0.0
    # d(hidden), d(fc1 out), d(fc2 in)
    backward = rebuilt + b * T * (shape.hidden + 3 * shape.mlp_width(lay.tp, lay.etp))
    head = _head_bytes(cfg, shape, lay, tokens) if pp_rank == lay.pp - 1 else 0.0
    if head >= backward:
        return Line("peak transient: log-prob head", head, _head_formula(cfg, shape, lay, tokens))
    again = f"{group} layer(s) rebuilt + " if rebuilt else ""
    return Line("peak transient: backward of a layer", backward, f"{again}{T} tokens x (h + 3f/TP) x B of gradients")


def _head_buffers(cfg: RunConfig, tokens: _Tokens) -> int:
    """fp32 [chunk, V/t] buffers at the head's peak: its chunk loop computes a chunk's logits while the last
    chunk's two buffers are still bound to their names (seen by tools/bench_memory.py), so three from the
    second chunk on."""
    return 3 if tokens.response_on_rank > cfg.model.logprob_chunk_size else 2


def _head_bytes(cfg: RunConfig, shape: ModelShape, lay: _Layout, tokens: _Tokens) -> float:
    b, rows = _DTYPE_BYTES[cfg.model.dtype], shape.vocab_rows(lay.tp)
    cast = b if b != 4 else 0  # fp32 gradients cast back to the model's dtype
    hidden = tokens.response_on_rank * shape.hidden * (b + 4 + cast)
    if not cfg.model.fused_logprobs:  # [T, V/t] logits, their fp32 copy, the softmax and its gradient
        return tokens.on_rank * rows * (b + 12) + hidden
    chunk = min(cfg.model.logprob_chunk_size, tokens.response_on_rank)
    return _head_buffers(cfg, tokens) * chunk * rows * 4 + rows * shape.hidden * (4 + cast) + hidden


def _head_formula(cfg: RunConfig, shape: ModelShape, lay: _Layout, tokens: _Tokens) -> str:
    rows = shape.vocab_rows(lay.tp)
    if not cfg.model.fused_logprobs:
        return f"{tokens.on_rank} tokens x {rows} vocab/TP x (B + 12) (full logits: model.fused_logprobs=false)"
    chunk = min(cfg.model.logprob_chunk_size, tokens.response_on_rank)
    return (
        f"{_head_buffers(cfg, tokens)} x {chunk} chunk x {rows} vocab/TP x 4 B + weight grad {rows} x "
        f"{shape.hidden} fp32 + {tokens.response_on_rank} response tokens x h"
    )


def _overhead_lines(lay: _Layout, transient: float) -> tuple[Line, ...]:
    if not lay.on_gpu:
        return ()
    formula = f"{_CUDA_CONTEXT_GIB} GiB (CUDA context, NCCL) + {_ALLOCATOR_SLACK:.0%} of the activations (allocator)"
    return (
        Line("CUDA context + allocator", _CUDA_CONTEXT_GIB * GIB + _ALLOCATOR_SLACK * transient, formula, "overhead"),
    )


# --- the rollout engine ---------------------------------------------------------------------------------------


class _EngineModel:
    """The engine's memory on one GPU: awake (generating), asleep (the actor trains), receiving weights."""

    def __init__(self, cfg: RunConfig, shape: ModelShape, lay: _Layout, tokens: _Tokens, gpu_gb: float):
        self.shape, self.lay, self.tokens = shape, lay, tokens
        self.ro, self.b = cfg.rollout, _DTYPE_BYTES[cfg.model.dtype]
        self.gpu = gpu_gb * GIB
        self.share = self.ro.gpu_memory_utilization * self.gpu
        self.sharded = self.ro.engine != "hf"  # HFEngine holds the whole model, without a memory fraction
        self.weights = shape.total_params() * self.b / (lay.engine_tp if self.sharded else 1)

    def weights_line(self) -> Line:
        split = f"/ engine TP {self.lay.engine_tp}" if self.sharded else "(hf engine: the whole model)"
        formula = f"{_count(self.shape.total_params())} params x {self.b} B {split}"
        return Line("engine weights", self.weights, formula, "engine")

    def workspace(self) -> float:
        """One forward of the engine's batch, its sampler's fp32 logits, CUDA graphs."""
        s, e = self.shape, self.lay.engine_tp
        batch = self.ro.max_num_batched_tokens or _ENGINE_BATCHED_TOKENS
        forward = batch * (2 * s.hidden + 2 * (s.q + 2 * s.k) / e + 3 * s.mlp_width(e, e)) * self.b
        graphs = _CUDA_GRAPHS_GIB * GIB if self.ro.cuda_graphs else 0.0
        return forward + _ENGINE_MAX_SEQS * s.vocab * 4 + graphs

    def start(self) -> EngineStart | None:
        if not self.lay.on_gpu or not self.sharded:  # HFEngine takes no fraction; nothing to refuse on the CPU
            return None
        return EngineStart(free=self.gpu - _CUDA_CONTEXT_GIB * GIB, asked=self.share)

    def kv_budget(self) -> float:
        if not self.sharded:  # HFEngine: a dynamic cache for its rows at the longest sequence
            return _HF_ENGINE_ROWS * self.tokens.sequence * self.shape.kv_bytes_per_token(1, self.b)
        if not self.lay.on_gpu:
            return self.ro.cpu_kv_cache_mb * (1 << 20)
        return self.share - self.weights - self.workspace()

    def kv_cache(self) -> KVCache | None:
        if not self.sharded:
            return None
        per_token = self.shape.kv_bytes_per_token(self.lay.engine_tp, self.b)
        prompts = self.ro.gen_prompts_per_round / self.lay.replicas
        wanted = prompts * self.ro.n_samples_per_prompt * (self.tokens.prompt + self.ro.sampling.max_response_len)
        sequence = self.ro.max_model_len or self.shape.max_positions
        return KVCache(tokens=max(self.kv_budget(), 0.0) / per_token, sequence=sequence, wanted=wanted)

    def awake(self) -> tuple[Line, ...]:
        if not self.lay.on_gpu or not self.sharded:
            kv = f"{_HF_ENGINE_ROWS} rows x the longest sequence" if not self.sharded else "rollout.cpu_kv_cache_mb"
            return self.weights_line(), Line("engine KV cache", self.kv_budget(), kv, "engine")
        formula = (
            f"rollout.gpu_memory_utilization {self.ro.gpu_memory_utilization:g} of the GPU: weights "
            f"{self.weights / GIB:.1f} + workspace {self.workspace() / GIB:.1f} + KV cache "
            f"{max(self.kv_budget(), 0.0) / GIB:.1f} GiB"
        )
        return (Line(f"engine ({self.ro.engine}, generating)", self.share, formula, "engine"),)

    def asleep(self) -> tuple[Line, ...]:
        level, name = self.ro.sleep_level, self.ro.engine
        if not self.lay.on_gpu:  # engines free nothing on the CPU
            return self.awake()
        if not self.sharded:
            return (Line("engine (hf)", 0.0, "HFEngine moves its model to host memory", "engine"),)
        if level == 0:
            return (Line(f"engine ({name}, sleep_level 0)", self.share, "keeps its whole share", "engine"),)
        what = "weights to host, KV cache freed" if level == 1 else "weights and KV cache freed"
        formula = f"sleep_level {level}: {what}; what it keeps (assumed)"
        return (Line(f"engine ({name}, asleep)", _ENGINE_ASLEEP_GIB * GIB, formula, "engine"),)

    def receiving(self) -> tuple[Line, ...]:
        """After the update the engine wakes its weights for the push; the actor is on the GPU whole."""
        if self.ro.sleep_level == 0:
            return self.asleep()
        mb = self.ro.weight_bucket_mb
        return (
            self.weights_line(),
            Line("engine residue", _ENGINE_ASLEEP_GIB * GIB, "CUDA graph pools, sampler buffers (assumed)", "engine"),
            Line("weight buckets", 2 * mb * (1 << 20), f"2 x rollout.weight_bucket_mb {mb} MiB", "engine"),
        )


# --- host memory a node ---------------------------------------------------------------------------------------


def _host_memory(
    cfg: RunConfig, shape: ModelShape, lay: _Layout, plan: MemoryPlan, assumed: Assumed
) -> HostMemory | None:
    """What a node's GPU processes hold in host memory (the module's docstring); None on the CPU, where the
    plan's phases are host memory already."""
    if not lay.on_gpu:
        return None
    n = min(lay.gpus, GPUS_PER_NODE)
    held = [
        *_engine_host_copy(cfg, shape, lay, n),
        *_offloaded_optimizer(cfg, plan, n),
        Line("the processes", n * _PROCESS_HOST_GIB * GIB,
             f"{n} x {_PROCESS_HOST_GIB:g} GiB: Python, torch, CUDA's host side, the libraries (assumed)"),
        *_verifier_workers(cfg, lay, n, assumed),
    ]  # fmt: skip
    passing = [_rollout_data(cfg, shape, lay, n, assumed)]
    saving = sum(line.bytes for line in plan.save_lines if line.name.startswith("save"))
    if saving:
        passing.append(Line("a save's staging", n * saving, f"{n} x {saving / GIB:.2f} GiB (checkpoints, above)"))
    # the rank's own optimizer share is read into place, a tensor at a time (dp_reshardable)
    reading = sum(
        line.bytes
        for line in plan.save_lines
        if line.name.startswith("resume") and line.name != "resume: the rank's optimizer share"
    )
    if reading:
        passing.append(Line("a resume's reads", n * reading, f"{n} x {reading / GIB:.2f} GiB (checkpoints, above)"))
    return HostMemory(n, tuple(line for line in held if line.bytes > 0), tuple(passing))


def _engine_host_copy(cfg: RunConfig, shape: ModelShape, lay: _Layout, n: int) -> tuple[Line, ...]:
    """vLLM at sleep_level 1 backs its weights up in pinned host memory, which PyTorch's pinned cache keeps between
    sleeps; the HF engine moves its whole model there. SGLang's memory saver and sleep_level 2 discard them (the
    next push refreshes them)."""
    ro, b = cfg.rollout, _DTYPE_BYTES[cfg.model.dtype]
    if ro.engine == "vllm" and ro.sleep_level == 1:
        per = shape.total_params() * b / lay.engine_tp
        formula = f"{n} x {_count(shape.total_params())} params x {b} B / engine TP {lay.engine_tp} (pinned)"
        return (Line("engine weights (vllm sleep_level 1)", n * per, formula),)
    if ro.engine == "hf":
        per = shape.total_params() * b
        return (Line("engine model (hf)", n * per, f"{n} x {_count(per / b)} params x {b} B"),)
    return ()


def _offloaded_optimizer(cfg: RunConfig, plan: MemoryPlan, n: int) -> tuple[Line, ...]:
    lines = []
    if cfg.optimizer.cpu_offload:
        per = sum(line.bytes for line in plan.host_lines)
        formula = f"{n} x {per / GIB:.2f} GiB: fp32 master, Adam moments, pinned fp32 gradients (above)"
        lines.append(Line("optimizer state (optimizer.cpu_offload)", n * per, formula))
    # offload_for_rollout moves the optimizer state off the GPU, but not the hybrid optimizer's (its GPU share stays)
    if cfg.rollout.offload_actor and not cfg.optimizer.cpu_offload:
        train = plan.phase("train")
        per = train.bytes_of("actor fp32 master") + train.bytes_of("actor Adam moments")
        formula = f"{n} x {per / GIB:.2f} GiB: fp32 master + Adam moments while generating (pinned)"
        lines.append(Line("optimizer state (rollout.offload_actor)", n * per, formula))
    return tuple(lines)


def _round_tokens(cfg: RunConfig, lay: _Layout, assumed: Assumed, mean_prompt: float) -> float:
    """Tokens of a generation round one engine replica holds, at the assumed mean answer."""
    ro = cfg.rollout
    prompts = ro.gen_prompts_per_round * (ro.partial_oversample if ro.partial_rollout else 1)
    mean_len = min(assumed.mean_len, ro.sampling.max_response_len)
    return prompts * ro.n_samples_per_prompt / lay.replicas * (mean_prompt + mean_len)


def _verifier_workers(cfg: RunConfig, lay: _Layout, n: int, assumed: Assumed) -> tuple[Line, ...]:
    """Each replica's scoring rank runs the verifier pool: algorithm.reward.workers, or with -1 one per
    ANSWERS_PER_WORKER answers of its round, up to the task's CPUs less one (rewards/pool.py host_workers)."""
    workers = cfg.algorithm.reward.workers
    answers = cfg.rollout.gen_prompts_per_round * cfg.rollout.n_samples_per_prompt / lay.replicas
    source = f"algorithm.reward.workers {workers}"
    if workers < 0:
        workers = min(max(1, assumed.cpu_threads - 1), max(1, math.ceil(answers / ANSWERS_PER_WORKER)))
        source = f"algorithm.reward.workers -1: a round's {answers:,.0f} answers, --cpus-per-task {assumed.cpu_threads}"
    replicas = max(1, n // lay.engine_tp)
    plural = "s" if replicas != 1 else ""
    # a pool for each distinct verifier (algorithm.reward.verifiers), each as large at most (rewards/by_source.py)
    pools = len({cfg.algorithm.reward.verifier, *cfg.algorithm.reward.verifiers.values()})
    per_pool = f" x {pools} verifiers" if pools > 1 else ""
    formula = f"{replicas} replica{plural}{per_pool} x {workers} workers x {_VERIFIER_WORKER_GIB:g} GiB ({source})"
    return (Line("verifier workers", replicas * pools * workers * _VERIFIER_WORKER_GIB * GIB, formula),)


def _rollout_data(cfg: RunConfig, shape: ModelShape, lay: _Layout, n: int, assumed: Assumed) -> Line:
    """A step's data on the host: the rank's share of the trained tokens (docs/rehearsal.md's 88 B a token) and
    the round its replica generated, held until the keep decision (with routing replay, its experts too)."""
    mean_prompt = _tokens(cfg, shape, lay).prompt / 2
    mean_len = min(assumed.mean_len, cfg.rollout.sampling.max_response_len)
    trained = step_answers(cfg) * (mean_prompt + mean_len) / lay.dp
    round_tokens = _round_tokens(cfg, lay, assumed, mean_prompt)
    routing = shape.moe_layers * shape.topk if cfg.model.routing_replay == "rollout" and shape.experts else 0
    per = trained * _DATA_BYTES_PER_TOKEN + round_tokens * (_ROUND_BYTES_PER_TOKEN + routing / lay.engine_tp)
    each = (
        f"({_ROUND_BYTES_PER_TOKEN} + {routing} B of routing / engine TP {lay.engine_tp})"
        if routing
        else f"{_ROUND_BYTES_PER_TOKEN} B"
    )
    formula = (
        f"{n} x ({trained / 1e6:.1f}M trained tokens a rank x {_DATA_BYTES_PER_TOKEN} B + a replica's round of "
        f"{round_tokens / 1e6:.1f}M tokens x {each}), at a mean answer of {mean_len:,.0f} tokens"
    )
    return Line("rollout data of a step", n * per, formula)


# --- words ----------------------------------------------------------------------------------------------------


def _describe_layout(cfg: RunConfig, shape: ModelShape, lay: _Layout, tokens: _Tokens) -> str:
    vpp = f" x VPP {lay.vpp}" if lay.vpp > 1 else ""
    sp = " + SP" if cfg.parallel.sequence_parallel else ""
    optimizer = "distributed optimizer" if cfg.parallel.use_distributed_optimizer else "replicated optimizer"
    layers = "Transformer Engine layers" if lay.fused else "local layers (unfused attention)"
    budget = cfg.trainer.max_tokens_per_micro_batch
    source = f"token budget {budget}" if budget else f"micro_batch_size {cfg.trainer.micro_batch_size}"
    experts = ""
    if shape.experts:
        experts = (
            f", {shape.experts} experts top-{shape.topk} in {shape.moe_layers} layers: EP {lay.ep} x expert TP "
            f"{lay.etp} x expert DP {lay.expert_dp}"
        )
    return (
        f"{shape.model_type} {_count(shape.total_params())} params (h {shape.hidden}, {shape.layers} layers, "
        f"vocab {shape.vocab}) on {lay.gpus} GPUs: TP {lay.tp}{sp} x PP {lay.pp}{vpp}{_cp_words(lay)} x DP "
        f"{lay.dp}{experts}, "
        f"{optimizer}; "
        f"engine {cfg.rollout.engine} TP {lay.engine_tp} x {lay.replicas} replicas\n"
        f"{cfg.model.dtype}, {layers}, recompute={cfg.model.recompute}; micro-batches of {tokens.micro_batch} "
        f"tokens ({source}; longest sequence {tokens.sequence} = prompt {tokens.prompt} + response "
        f"{cfg.rollout.sampling.max_response_len}), {tokens.micro_batches} per DP rank and mini-batch"
    )


def _cp_note(cfg: RunConfig, shape: ModelShape, lay: _Layout, tokens: _Tokens, pp_rank: int) -> tuple[str, ...]:
    """At CP > 1: the actor's activations a GPU beside CP 1's on the same GPUs (each sequence whole on a rank)."""
    if lay.cp == 1:
        return ()
    whole = dataclasses.replace(tokens, cp=1)
    at_cp1 = dataclasses.replace(lay, cp=1, dp=lay.dp * lay.cp)

    def activations(layout: _Layout, toks: _Tokens) -> float:
        return _activation_lines(cfg, shape, layout, toks, pp_rank)[0].bytes

    return (
        f"context parallelism {lay.cp}: actor activations {activations(lay, tokens) / GIB:.2f} GiB a GPU, "
        f"{tokens.on_rank} of each micro-batch's {tokens.micro_batch} tokens (at CP 1 on these GPUs: "
        f"{activations(at_cp1, whole) / GIB:.2f} GiB); the K/V all-gather moves (CP-1)/CP of "
        f"{2 * tokens.sequence * shape.k / lay.tp * _DTYPE_BYTES[cfg.model.dtype] / 2**20:.1f} MiB a layer and "
        "gather",
    )


def _cp_words(lay: _Layout) -> str:
    return f" x CP {lay.cp}" if lay.cp > 1 else ""


def _notes(cfg: RunConfig, lay: _Layout, tokens: _Tokens) -> tuple[str, ...]:
    notes = []
    if lay.pp > 1 and cfg.trainer.max_tokens_per_micro_batch:
        notes.append(
            "PP > 1 pads every micro-batch to one shape (the most rows x the longest row, mcore/actor.py "
            "_one_shape): with mixed lengths a micro-batch can exceed the token budget planned here"
        )
    if cfg.model.fp8 != "none":
        notes.append("model.fp8: FP8 weight copies and scaling state are not counted")
    if not cfg.data.max_prompt_len:
        notes.append(
            f"data.max_prompt_len is 0: planned with prompts of {tokens.prompt} tokens (the model's positions "
            "minus max_response_len); set it to your data's longest prompt"
        )
    return tuple(notes)


def _count(n: float) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.{3 if unit == 'B' else 1}f}{unit}"
    return f"{n:.0f}"


def format_plan(plan: MemoryPlan, gpus_from: str = "") -> str:
    """The plan as a table, one line per item with its formula, then the verdict and what would help."""
    out = [plan.layout, f"GPUs: {plan.gpus}" + (f" ({gpus_from})" if gpus_from else ""), ""]
    for phase in plan.phases:
        out.append(f"{phase.name} ({plan.stage}){'  <- peak' if phase is plan.peak else ''}")
        out += [f"  {line.name:<38}{line.bytes / GIB:>8.2f} GiB  {line.formula}" for line in phase.lines]
        out += [f"  {'total':<38}{phase.total / GIB:>8.2f} GiB of {plan.gpu_bytes / GIB:g}", ""]
    if plan.kv is not None:
        out += [_kv_summary(plan.kv)]
    if plan.engine_start is not None:
        out += [_engine_start_summary(plan.engine_start, plan.gpu_bytes)]
    out += [""] if plan.kv is not None or plan.engine_start is not None else []
    if plan.host_lines:
        out.append(f"host memory per GPU's process ({plan.stage}), beside the GPU's:")
        out += [f"  {line.name:<38}{line.bytes / GIB:>8.2f} GiB  {line.formula}" for line in plan.host_lines]
        host = sum(line.bytes for line in plan.host_lines)
        out += [f"  {'total':<38}{host / GIB:>8.2f} GiB; x the GPUs of a node (8: {8 * host / GIB:.0f} GiB)", ""]
    out += _save_summary(plan)
    out += _host_summary(plan.host) if plan.host is not None else []
    out += [format_step_time(plan.step_time), ""] if plan.step_time is not None else []
    out += [f"note: {note}" for note in plan.notes]
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    out.append(f"{verdict}: peak {plan.peak.total / GIB:.1f} GiB ({plan.peak.name}) of {plan.gpu_bytes / GIB:g} GiB")
    if not plan.kv_fits:
        out.append(f"the engine's KV cache does not hold one sequence of {plan.kv.sequence} tokens")
    if not plan.engine_starts:
        out.append("the engine would be refused at start: it asks for more than is free then")
    if plan.suggestions:
        out.append("what would help (each change alone, and what it takes off the peak):")
        out += [f"  {s.change}  (-{s.saves / GIB:.1f} GiB{', fits' if s.fits else ''})" for s in plan.suggestions]
    return "\n".join(out)


def _save_summary(plan: MemoryPlan) -> list[str]:
    if not plan.save_lines:
        return []
    out = [f"checkpoints, per GPU's process ({plan.stage}; no GPU memory beyond the step's):"]
    out += [f"  {line.name:<38}{line.bytes / GIB:>8.2f} GiB  {line.formula}" for line in plan.save_lines]
    saving = sum(line.bytes for line in plan.save_lines if line.name.startswith("save"))
    resuming = sum(line.bytes for line in plan.save_lines if line.name.startswith("resume"))
    return out + [
        f"  a node of 8 GPUs: a save stages at most {8 * saving / GIB:.0f} GiB in host memory; a resume reads "
        f"{8 * resuming / GIB:.0f} GiB from storage (checkpoint.optimizer_format)",
        "",
    ]


def host_memory_line(host: HostMemory) -> str:
    """`host memory a node: N GiB (its parts)`: what a Slurm job's --mem must cover."""
    held = " + ".join(f"{line.name} {line.bytes / GIB:.0f}" for line in host.held)
    largest = host.largest_passing
    then = f"; on top, at most {largest.name} {largest.bytes / GIB:.0f}" if largest is not None else ""
    return (
        f"host memory a node: {host.peak / GIB:.0f} GiB ({host.processes} GPU processes; held throughout: {held}"
        f"{then} GiB; the page cache is not counted)"
    )


def _host_summary(host: HostMemory) -> list[str]:
    out = [host_memory_line(host)]
    out += [f"  {line.name:<42}{line.bytes / GIB:>8.2f} GiB  {line.formula}" for line in host.held]
    out.append("  on top, one at a time:")
    out += [f"  {line.name:<42}{line.bytes / GIB:>8.2f} GiB  {line.formula}" for line in host.passing]
    return out + [
        f"  sbatch: --mem={host.mem_gib}G (the peak + {_MEM_MARGIN:.0%}, in steps of {_MEM_STEP_GIB} GiB), or "
        "--mem=0 (all of a node's memory: slurm/train.sbatch's default)",
        "",
    ]


def _engine_start_summary(start: EngineStart, gpu: float) -> str:
    verdict = "margin" if start.fits else "SHORT by"
    return (
        f"engine start: asks {start.asked / GIB:.1f} GiB free (rollout.gpu_memory_utilization x "
        f"{gpu / GIB:g} GiB); {start.free / GIB:.1f} GiB is (all but the CUDA context: it starts before the "
        f"actor allocates): {verdict} {abs(start.free - start.asked) / GIB:.1f} GiB"
    )


def _kv_summary(kv: KVCache) -> str:
    return (
        f"KV cache per engine replica: {kv.tokens / 1e6:.2f}M tokens = {kv.tokens / kv.sequence:.1f} sequences of "
        f"{kv.sequence} at once; a generation round wants {kv.wanted / 1e6:.1f}M tokens per replica (prompts x n x "
        f"(prompt + response)): at full length it runs in about {kv.wanted / max(kv.tokens, 1.0):.0f} waves"
    )


# --- when it does not fit -------------------------------------------------------------------------------------


def _candidates(cfg: RunConfig, shape: ModelShape, gpus: int) -> list[tuple[str, list[str], int]]:
    """Changes worth trying, each alone: (what it does, overrides, GPUs)."""
    par, tr, ro = cfg.parallel, cfg.trainer, cfg.rollout
    tp, pp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size
    out: list[tuple[str, list[str], int]] = []
    if cfg.model.recompute != "full":
        out.append(("recompute activations in backward", ["model.recompute=full"], gpus))
    if tr.max_tokens_per_micro_batch > 0:
        half = tr.max_tokens_per_micro_batch // 2
        out.append(("halve the micro-batch token budget", [f"trainer.max_tokens_per_micro_batch={half}"], gpus))
    elif tr.micro_batch_size > 1:
        out.append(("halve the micro-batch", [f"trainer.micro_batch_size={tr.micro_batch_size // 2}"], gpus))
    if tp > 1 and not par.sequence_parallel:
        out.append(("split activations over TP", ["parallel.sequence_parallel=true"], gpus))
    if not par.use_distributed_optimizer:
        out.append(("shard the optimizer over DP", ["parallel.use_distributed_optimizer=true"], gpus))
    if 2 * tp <= 8:  # within an 8-GPU node
        out.append((f"raise TP to {2 * tp}", [f"parallel.tensor_model_parallel_size={2 * tp}",
                                              "parallel.sequence_parallel=true"], gpus))  # fmt: skip
    out.append((f"raise PP to {2 * pp}", [f"parallel.pipeline_model_parallel_size={2 * pp}"], gpus))
    if not ro.offload_actor:
        out.append(("move grads and Adam moments off the GPU while generating", ["rollout.offload_actor=true"], gpus))
    if ro.gpu_memory_utilization > 0.2:
        lower = round(ro.gpu_memory_utilization - 0.1, 2)
        out.append(("give the engine less", [f"rollout.gpu_memory_utilization={lower}"], gpus))
    if ro.sleep_level == 0:
        out.append(("let the engine sleep while the actor trains", ["rollout.sleep_level=1"], gpus))
    if not cfg.optimizer.cpu_offload and par.use_distributed_optimizer:
        out.append(("keep the optimizer in host memory", ["optimizer.cpu_offload=true"], gpus))
    out.append(("run on twice the GPUs (more DP shards of the optimizer)", [], 2 * gpus))
    return out


def _suggestions(
    cfg: RunConfig, hf: dict[str, Any], gpu_gb: float, gpus: int, plan: MemoryPlan
) -> tuple[Suggestion, ...]:
    found = []
    for what, overrides, n_gpus in _candidates(cfg, ModelShape.from_hf(hf), gpus):
        try:
            after = _plan(_with_overrides(cfg, overrides), hf, gpu_gb, n_gpus)
        except (ConfigError, LayoutError):  # a layout the model or the GPU count cannot take
            continue
        saves = plan.peak.total - after.peak.total
        unblocks = (after.kv_fits and not plan.kv_fits) or (after.engine_starts and not plan.engine_starts)
        if saves > 0 or unblocks:
            found.append(Suggestion(f"{what}: {' '.join(overrides) or f'--gpus {n_gpus}'}", saves, after.fits))
    return tuple(sorted(found, key=lambda s: (not s.fits, -s.saves)))


def _with_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """A copy of cfg with `section.key=value` overrides applied."""
    out = copy.deepcopy(cfg)
    for text in overrides:
        key, value = parse_override(text)
        *path, leaf = key.split(".")
        node = out
        for part in path:
            node = getattr(node, part)
        setattr(node, leaf, float(value) if isinstance(getattr(node, leaf), float) else value)
    return out


# --- the command ----------------------------------------------------------------------------------------------


def read_model_config(model_config: str | None, hf_path: str) -> dict[str, Any]:
    """config.json from --model-config (a directory or the file itself), else from model.hf_path."""
    where = Path(model_config or hf_path)
    path = where if where.is_file() else where / "config.json"
    if not path.is_file():
        source = "--model-config" if model_config else "model.hf_path"
        raise ConfigError(f"no config.json at {path} ({source}); plan without the weights with --model-config DIR")
    return read_config_json(path)


def checkpoint_bytes(model_config: dict[str, Any], dtype: str) -> int:
    """Size of one run checkpoint: the weights in their dtype plus the distributed optimizer's fp32 main params
    and Adam moments (12 bytes a parameter; SmolLM2-135M in fp32 saves 2,058 MiB, this says 2,052)."""
    return ModelShape.from_hf(model_config).total_params() * ({"float32": 4}.get(dtype, 2) + 12)


def plan_command(
    config_path: str,
    overrides: list[str],
    gpu_gb: float,
    model_config: str | None,
    gpus: int | None = None,
    assumed: Assumed = Assumed(),
) -> int:
    """`dapo-mcore plan CONFIG [overrides] [--gpu-gb 80] [--model-config DIR] [--gpus N] [--mean-len N]
    [--keep-rate F] [--mfu F]`: print the per-GPU memory plan and the step-time estimate; 0 if it fits, 1 if
    not."""
    cfg = load_config(config_path, overrides)
    plan = plan_memory(cfg, read_model_config(model_config, cfg.model.hf_path), gpu_gb, gpus, assumed)
    print(format_plan(plan, gpus_from="--gpus" if gpus else _gpus_source()))
    return 0 if plan.fits else 1


def _gpus_source() -> str:
    for key in ("WORLD_SIZE", "SLURM_NTASKS"):
        if os.environ.get(key, "").isdigit():
            return f"${key}"
    return "one 8-GPU node by default; pass --gpus N"
