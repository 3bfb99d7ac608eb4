"""A recipe in miniature: the recipe's exact combination of knobs on 2-4 gloo processes of the CPU, with a tiny
model of its family, for a few steps (DESIGN.md, "recipes in miniature"; tests/dist/test_recipes_in_miniature.py
runs each file of examples/ so, its save and an exact resume included).

`miniature(cfg, hf)` turns a recipe's config (and its model's config.json, where one is found) into overrides:

- the model: examples/models/tiny-arith for a dense model (Llama, Qwen2: the H100 recipes' Qwen2.5 and the CPU
  recipes' SmolLM2), examples/models/tiny-arith-moe for a mixture of experts (Qwen3-30B-A3B); their task, the
  arithmetic problems (a recipe's prompt file and its instruction would not fit their 128 positions);
- the layout: every parallel dimension the recipe uses above 1 kept, cut to 2 (TP 2 keeps its sequence
  parallelism, PP 2 its VPP where the tiny model's layers allow it, EP 2, CP 2), and data parallelism 2 (every recipe
  trains data-parallel at its GPU count; a CPU recipe's one process gets a second rank) within a world of 4;
- the counts: 2 prompts x at most 8 answers a step, at most 2 updates a step, answers of at most 32 tokens, the
  lengths the recipe relates to its answer length (overlong buffer, length penalty, loss_norm_len) and its token
  budget scaled with it, so that a rank's update still spans several micro-batches (and, under expert
  parallelism, a padding one where the ranks' counts differ);
- what runs on the CPU only (cpu_overrides, shared with the rehearsal: setup.py): the CPU mode, fp32, the local
  layers, no CPU-offloaded optimizer (Megatron's hybrid optimizer needs Transformer Engine and a GPU), no held-out
  evaluation; the rollout engine is `hf` at engine TP 1: the recipes' vLLM needs a GPU, and the hf engine has no
  tensor parallelism (the engine's TP is what the rehearsal keeps, with its synthetic engine; the hf engine keeps
  the recipe's verifier, and the actor's log-probs checked against the engine's, the weight push of the layout);
- every other knob as the recipe sets it: recompute, token budget (scaled), packing (as on the recipe's device:
  `auto` with Transformer Engine on a GPU is padded rows), MoE aux loss and dispatcher, routing replay, partial
  rollout, carry-over, the loss, its aggregation and corrections, KL, dynamic sampling, the optimizer and its
  distributed form, the save's optimizer format, rollout.offload_actor.

SHRUNK names every key the miniature may set otherwise than the recipe (the test holds every other key equal).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dapo_mcore.config import RunConfig
from dapo_mcore.utils.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY_DENSE = EXAMPLES / "models" / "tiny-arith"  # Llama, 2 layers, 4 heads / 2 KV heads, 128 positions
TINY_MOE = EXAMPLES / "models" / "tiny-arith-moe"  # Qwen3-MoE, 2 sparse layers of 8 experts, top-2
TINY_LAYERS = 2
# The tiny models' task: 'What is a+b?' (at most 15 tokens with BOS in their character tokenizer) and an answer
# of at most RESPONSE_LEN tokens (their sampled answers average about 22: some reach the overlong zone and the cap).
PROMPT_LEN, RESPONSE_LEN = 16, 32
PROMPTS, ANSWERS, MOST_UPDATES, STEPS = 2, 8, 2, 2
DATA_PARALLEL, LARGEST_WORLD = 2, 4

# What a miniature may set otherwise than its recipe (fnmatch patterns); each is set in miniature() with why.
SHRUNK = (
    "logging.run_dir", "logging.plot", "logging.progress", "logging.wandb.mode",
    "checkpoint.dir", "checkpoint.resume", "checkpoint.save_interval", "checkpoint.keep_last",
    "checkpoint.hf_export_interval", "trainer.steps", "trainer.eval_interval",
    "model.hf_path", "model.init", "model.mcore_path", "model.dtype", "model.transformer_impl", "model.fp8",
    "model.recompute_num_layers",
    "parallel.device", "parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
    "parallel.virtual_pipeline_model_parallel_size", "parallel.expert_model_parallel_size",
    "parallel.expert_tensor_parallel_size", "parallel.context_parallel_size",
    "optimizer.cpu_offload",
    "rollout.engine", "rollout.engine_tp_size", "rollout.max_model_len", "rollout.n_samples_per_prompt",
    "rollout.prompts_per_step", "rollout.gen_prompts_per_round", "rollout.sampling.max_response_len",
    "trainer.mini_batch_size", "trainer.micro_batch_size", "trainer.max_tokens_per_micro_batch", "trainer.packing",
    "algorithm.overlong.buffer_len", "algorithm.length_penalty.safe_len", "algorithm.length_penalty.max_len",
    "algorithm.loss_norm_len",
    "data.source", "data.template", "data.instruction", "data.system_prompt", "data.max_prompt_len",
    "data.eval_files",
)  # fmt: skip


def cpu_overrides() -> list[str]:
    """What every CPU run of a recipe sets, whatever else it shrinks: the rehearsal's and the miniature's."""
    return [
        "parallel.device=cpu",
        "model.dtype=float32",  # the CPU mode computes in fp32 only (gloo)
        "model.transformer_impl=local",  # Transformer Engine is GPU-only
        "model.fp8=none",  # FP8 matmuls are Transformer Engine's
        # Megatron's HybridDeviceOptimizer steps host copies of a GPU's parameters, through the precision-aware
        # optimizer, whose config needs Transformer Engine (GPU-only): the actor refuses it on the CPU (mcore/
        # provider.py cpu_offload_problem); past that refusal Megatron-Core 0.16.1 fails in OptimizerConfig
        # (is_te_min_version: "'>=' not supported between 'NoneType' and 'Version'", seen on the CPU). The
        # optimizer state is in host memory there already.
        "optimizer.cpu_offload=false",
        # held-out files are the recipes' downloads (data/aime24.jsonl); validation has tests of its own
        "data.eval_files=",
        "trainer.eval_interval=0",
        "checkpoint.hf_export_interval=0",
        "logging.wandb.mode=disabled",
    ]


def packing_on_its_device(cfg: RunConfig) -> str:
    """trainer.packing as the recipe's own device runs it: `auto` is padded rows with Transformer Engine (a
    recipe for GPUs: mcore/actor.py packing_mode), packed rows with the local layers (a CPU recipe)."""
    if cfg.trainer.packing == "auto" and cfg.parallel.device != "cpu":
        return "off"
    return cfg.trainer.packing


@dataclass(frozen=True)
class Layout:
    """A miniature's actor layout; data parallelism fills the world (world = TP x PP x CP x DP)."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 0  # expert TP; 0: the same as TP
    sp: bool = False
    dp: int = DATA_PARALLEL
    cp: int = 1  # context parallelism: each sequence split over cp ranks

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def layout_free(self) -> bool:
        """No model (or sequence) parallelism: every rank holds the whole model and whole sequences (data
        parallelism only)."""
        return self.tp == self.pp == self.ep == self.cp == 1

    def overrides(self) -> list[str]:
        return [
            f"parallel.tensor_model_parallel_size={self.tp}",
            f"parallel.sequence_parallel={str(self.sp).lower()}",
            f"parallel.pipeline_model_parallel_size={self.pp}",
            f"parallel.virtual_pipeline_model_parallel_size={self.vpp}",
            f"parallel.expert_model_parallel_size={self.ep}",
            f"parallel.expert_tensor_parallel_size={self.etp}",
            f"parallel.context_parallel_size={self.cp}",
        ]

    def without_model_parallelism(self) -> Layout:
        """The same world as data parallelism alone: the layout-free reference of this layout (the same engine
        replicas, so the same rollouts; its gradients are the layout's, DESIGN.md rule 10)."""
        return Layout(dp=self.world)

    def describe(self) -> str:
        parts = [f"TP {self.tp}" + (" + SP" if self.sp else "")] if self.tp > 1 else []
        parts += [f"PP {self.pp}" + (f" x VPP {self.vpp}" if self.vpp > 1 else "")] if self.pp > 1 else []
        parts += [f"CP {self.cp}"] if self.cp > 1 else []
        experts = f", EP {self.ep} over TP x DP" if self.ep > 1 else ""
        return " x ".join([*parts, f"DP {self.dp}"]) + f"{experts} ({self.world} ranks)"


def _cut(size: int) -> int:
    return 2 if size > 1 else 1


def miniature_layout(cfg: RunConfig, layers: int = TINY_LAYERS) -> Layout:
    """Every parallel dimension the recipe uses above 1 cut to 2, and DP 2 where the world stays within 4."""
    par = cfg.parallel
    tp, pp, ep, cp = (_cut(n) for n in (par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                                         par.expert_model_parallel_size, par.context_parallel_size))  # fmt: skip
    vpp = par.virtual_pipeline_model_parallel_size if pp > 1 else 1
    if layers % (pp * vpp):  # the tiny model's 2 layers hold PP 2 but no virtual stages on top
        vpp = 1
    etp = par.expert_tensor_parallel_size if par.expert_tensor_parallel_size <= 1 else min(2, tp)
    dp = DATA_PARALLEL if tp * pp * cp * DATA_PARALLEL <= LARGEST_WORLD else 1
    layout = Layout(tp, pp, vpp, ep, etp, par.sequence_parallel and tp > 1, dp, cp)
    if layout.world > LARGEST_WORLD:
        raise ConfigError(f"the miniature's {layout.describe()} needs more than {LARGEST_WORLD} ranks")
    expert_ranks = ep * (etp or tp) * pp
    if layout.world % expert_ranks:
        raise ConfigError(f"the miniature's {layout.describe()} cannot hold EP {ep} x expert TP {etp or tp} x PP {pp}")
    return layout


def recipe_model_config(cfg: RunConfig, examples: Path = EXAMPLES) -> dict[str, Any] | None:
    """The recipe's model config.json: at model.hf_path, else examples/models/<its name> (the H100 recipes'
    configs without weights, with or without a -Base / -Instruct suffix); None when neither is there."""
    if not cfg.model.hf_path:
        return None
    name = Path(cfg.model.hf_path).name
    candidates = [Path(cfg.model.hf_path), examples / "models" / name]
    candidates += [examples / "models" / name.removesuffix(suffix) for suffix in ("-Base", "-Instruct")]
    for where in candidates:
        if (where / "config.json").is_file():
            return json.loads((where / "config.json").read_text())
    return None


def is_moe(cfg: RunConfig, hf: dict[str, Any] | None) -> bool:
    """A mixture of experts: its config.json has experts; without one, the recipe splits experts (EP > 1)."""
    if hf is not None:
        return bool(hf.get("num_experts") or hf.get("num_local_experts"))
    return cfg.parallel.expert_model_parallel_size > 1


@dataclass(frozen=True)
class Miniature:
    recipe: str  # the recipe's file stem
    layout: Layout
    overrides: tuple[str, ...]
    model: Path

    @property
    def world(self) -> int:
        return self.layout.world

    def reference_overrides(self) -> list[str] | None:
        """The same miniature without model parallelism at the same world (its rollouts are the same: as many
        engine replicas), or None where the layout has none to take away."""
        if self.layout.layout_free:
            return None
        return [*self.overrides, *self.layout.without_model_parallelism().overrides()]


def _scaled(length: int, factor: float) -> int:
    return max(1, round(length * factor))


def miniature(cfg: RunConfig, hf: dict[str, Any] | None, recipe: str = "") -> Miniature:
    """The overrides that make the recipe `cfg` (its model's config.json `hf`, None if not found) its miniature."""
    ro, tr, alg = cfg.rollout, cfg.trainer, cfg.algorithm
    layout = miniature_layout(cfg)
    model = TINY_MOE if is_moe(cfg, hf) else TINY_DENSE
    # counts: a few prompts and answers, the recipe's over-sampling of rounds and (up to MOST_UPDATES) its updates
    answers, prompts = min(ro.n_samples_per_prompt, ANSWERS), min(ro.prompts_per_step, PROMPTS)
    per_round = max(prompts, round(prompts * ro.gen_prompts_per_round / ro.prompts_per_step))
    updates = min(MOST_UPDATES, max(1, ro.prompts_per_step * ro.n_samples_per_prompt // tr.mini_batch_size))
    mini_batch = prompts * answers // updates
    # without a token budget: two micro-batches a rank and update
    micro_batch = max(1, mini_batch // layout.dp // 2)
    response = min(ro.sampling.max_response_len, RESPONSE_LEN)
    factor = response / ro.sampling.max_response_len
    out = [
        *cpu_overrides(),
        f"model.hf_path={model}",
        "model.init=hf",
        "model.mcore_path=",
        f"model.recompute_num_layers={min(cfg.model.recompute_num_layers, TINY_LAYERS // layout.pp)}",
        *layout.overrides(),
        # the recipes' vLLM (and SGLang) need a GPU; the hf engine has no tensor parallelism
        "rollout.engine=hf",
        "rollout.engine_tp_size=1",
        "rollout.max_model_len=0",  # the tiny model's 128 positions
        f"rollout.n_samples_per_prompt={answers}",
        f"rollout.prompts_per_step={prompts}",
        f"rollout.gen_prompts_per_round={per_round}",
        f"rollout.sampling.max_response_len={response}",
        f"trainer.mini_batch_size={mini_batch}",
        f"trainer.micro_batch_size={micro_batch}",
        f"trainer.max_tokens_per_micro_batch={scaled_token_budget(cfg, hf)}",
        f"trainer.packing={packing_on_its_device(cfg)}",
        # the tiny models' task; their 128 positions hold no instruction or chat template (nor have they one)
        "data.source=arithmetic",
        "data.template=none",
        "data.instruction=none",
        "data.system_prompt=",
        "data.max_prompt_len=0",
        f"trainer.steps={STEPS}",
        "checkpoint.dir=",  # the run directory's: a copy of it resumes from its own saves
        "checkpoint.resume=none",
        "checkpoint.save_interval=1",
        f"checkpoint.keep_last={STEPS}",
        "logging.plot=false",
        "logging.progress=false",
    ]
    if alg.overlong.enabled:
        out.append(f"algorithm.overlong.buffer_len={min(_scaled(alg.overlong.buffer_len, factor), response - 1)}")
    if alg.length_penalty.enabled:
        lp = alg.length_penalty
        out += [f"algorithm.length_penalty.safe_len={_scaled(lp.safe_len, factor)}",
                f"algorithm.length_penalty.max_len={_scaled(lp.max_len, factor)}"]  # fmt: skip
    if alg.loss_norm_len:
        out.append(f"algorithm.loss_norm_len={_scaled(alg.loss_norm_len, factor)}")
    return Miniature(recipe or cfg.name, layout, tuple(out), model)


def scaled_token_budget(cfg: RunConfig, hf: dict[str, Any] | None) -> int:
    """The recipe's trainer.max_tokens_per_micro_batch in proportion to its longest sequence (prompt + answer),
    applied to the miniature's longest (PROMPT_LEN + RESPONSE_LEN), in whole granules of 8: the H100 recipes'
    32768 over 2048 + 20480 (a micro-batch holds one full-length sample or several shorter ones) gives 72 over 48.
    0 (no budget) stays 0."""
    budget = cfg.trainer.max_tokens_per_micro_batch
    if not budget:
        return 0
    response = cfg.rollout.sampling.max_response_len
    prompt = cfg.data.max_prompt_len or max(0, (hf or {}).get("max_position_embeddings", response) - response)
    longest = PROMPT_LEN + min(response, RESPONSE_LEN)
    return 8 * math.ceil(budget / (prompt + response) * longest / 8)
