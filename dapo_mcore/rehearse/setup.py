"""A recipe made into a rehearsal: the same config with the synthetic engine, a shrunk model and the counts of
the chosen mode, on N CPU (gloo) processes (docs/rehearsal.md).

The shrunk model keeps what every per-token and per-expert array is sized by (the vocabulary, the experts, the
top-k) and cuts what only the compute is (hidden size, heads, FFN width, layers). Each rehearsal process is one
data-parallel rank of the actor (TP 1; with the recipe's context parallelism, cut to 2, one CP rank of a DP rank)
and one engine replica. Two modes:

- per-rank: each process carries the load one rank of the recipe's world carries (its share of the step's
  prompts and answers, of each round's prompts per engine replica, of each mini-batch), scaled by `load`;
  run at several N, so that what a rank holds can be compared as N grows with its own share held;
- full-count: the recipe's global counts (prompts_per_step x n answers, gen_prompts_per_round a round), split
  over N processes (2 by default): what a per-rank array of every token of the step costs, at its real size.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dapo_mcore.config import RunConfig
from dapo_mcore.rehearse.miniature import cpu_overrides
from dapo_mcore.utils.errors import ConfigError

# The demo's character tokenizer: a rehearsal's prompts are tokenized by it, and the synthetic engine draws
# answer tokens from it (token ids below its 100 entries, whatever the model's vocabulary).
TOKENIZER_DIR = Path(__file__).resolve().parents[2] / "examples" / "models" / "tiny-arith"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
# The shrunk architecture: 4 heads of 16 (GQA kept: 1 or more KV heads), FFN 128, 2 layers (MoE: both sparse).
HIDDEN, HEADS, HEAD_DIM, FFN, LAYERS, EXPERT_FFN = 64, 4, 16, 128, 2, 32
# A per-rank load of about this many generated tokens a round when `load` is not given.
TOKENS_PER_RANK_ROUND = 2_000_000

Mode = Literal["per-rank", "full-count"]


@dataclass(frozen=True)
class RecipeShape:
    """What of the recipe sets a rank's share: its world (the job's GPUs), layout and counts."""

    gpus: int
    dp: int  # actor data-parallel ranks: gpus / (TP x PP x CP)
    replicas: int  # engine replicas: gpus / rollout.engine_tp_size
    prompts_per_step: int
    answers_per_prompt: int
    prompts_per_round: int
    mini_batch_size: int  # answers per optimizer update
    max_response_len: int
    micro_batch_size: int = 1  # the smallest mini-batch the trainer takes
    expert_parallel: int = 1  # the recipe's EP
    engine_tp: int = 1  # the recipe's rollout.engine_tp_size
    context_parallel: int = 1  # the recipe's CP

    def expert_parallel_at(self, world: int) -> int:
        """The EP a rehearsal of `world` processes runs (each one DP rank at TP 1): the largest that divides both
        the recipe's and the world, so that the expert all-to-alls and the equal micro-batch counts across an EP
        group that they need are exercised as in the recipe."""
        return math.gcd(self.expert_parallel, world)

    def engine_tp_at(self, world: int) -> int:
        """The engine TP a rehearsal of `world` processes runs, the largest that divides both the recipe's and the
        world: an engine replica's ranks then generate alike, agree on its verdicts and (partial rollout) stop
        together, and take turns sending its groups, as in the recipe."""
        return math.gcd(self.engine_tp, world)

    def context_parallel_at(self, world: int) -> int:
        """The CP a rehearsal of `world` processes runs: the recipe's cut to 2 (as the miniatures cut it), where
        the world holds it; each CP pair is then one data-parallel rank that splits its sequences, gathers K and V
        over the pair in every layer (counted by the probes) and reduces its loss and gradients over it."""
        return 2 if self.context_parallel > 1 and world % 2 == 0 else 1

    @classmethod
    def of(cls, cfg: RunConfig, gpus: int) -> RecipeShape:
        par, ro = cfg.parallel, cfg.rollout
        model_parallel = par.tensor_model_parallel_size * par.pipeline_model_parallel_size * par.context_parallel_size
        if gpus % model_parallel or gpus % ro.engine_tp_size:
            raise ConfigError(
                f"--gpus {gpus} is not a multiple of the recipe's TP x PP x CP ({model_parallel}) and engine TP "
                f"({ro.engine_tp_size}): give the job's GPU count"
            )
        return cls(
            gpus,
            gpus // model_parallel,
            gpus // ro.engine_tp_size,
            ro.prompts_per_step,
            ro.n_samples_per_prompt,
            ro.gen_prompts_per_round,
            cfg.trainer.mini_batch_size,
            ro.sampling.max_response_len,
            cfg.trainer.micro_batch_size,
            par.expert_model_parallel_size,
            ro.engine_tp_size,
            par.context_parallel_size,
        )

    @property
    def updates_per_step(self) -> int:
        return max(1, self.prompts_per_step * self.answers_per_prompt // self.mini_batch_size)

    def round_tokens_per_replica(self, mean_len: float) -> float:
        return self.prompts_per_round / self.replicas * self.answers_per_prompt * min(mean_len, self.max_response_len)


@dataclass(frozen=True)
class Counts:
    """The rehearsal's step: prompts trained, prompts a round, answers per update, over `world` processes."""

    world: int
    prompts_per_step: int
    prompts_per_round: int
    mini_batch_size: int

    def overrides(self) -> list[str]:
        return [
            f"rollout.prompts_per_step={self.prompts_per_step}",
            f"rollout.gen_prompts_per_round={self.prompts_per_round}",
            f"trainer.mini_batch_size={self.mini_batch_size}",
        ]


def default_load(shape: RecipeShape, mean_len: float) -> float:
    """The share of one recipe rank's load a per-rank process carries when none is given: about
    TOKENS_PER_RANK_ROUND generated tokens a round (the 2-core machine holds 8 such processes), at most 1."""
    return min(1.0, TOKENS_PER_RANK_ROUND / shape.round_tokens_per_replica(mean_len))


def per_rank_counts(shape: RecipeShape, world: int, load: float) -> Counts:
    """`world` processes, each with `load` x the share of one recipe rank: its DP share of the step's prompts
    and of each mini-batch (under context parallelism a DP rank's share, split over its CP ranks, as in the
    recipe); each of the rehearsal's engine replicas `load` x a recipe replica's share of each round's prompts
    (at least its ranks' prompts)."""
    prompts = max(1, round(load * shape.prompts_per_step / shape.dp))
    engine_tp = shape.engine_tp_at(world)
    per_round = max(prompts * engine_tp, round(load * shape.prompts_per_round / shape.replicas))
    dp = world // shape.context_parallel_at(world)
    answers = dp * prompts * shape.answers_per_prompt
    # the recipe's updates a step, as far as the trainer's micro-batch size lets a small load keep them
    mini_batch = max(shape.micro_batch_size, answers // shape.updates_per_step)
    return Counts(world, dp * prompts, world // engine_tp * per_round, min(mini_batch, answers))


def full_counts(shape: RecipeShape, world: int) -> Counts:
    return Counts(world, shape.prompts_per_step, shape.prompts_per_round, shape.mini_batch_size)


def shrink_model(hf: dict[str, Any], out_dir: Path, positions: int = 0) -> Path:
    """The recipe's architecture with its compute cut (hidden 64, 4 heads of 16, FFN 128, 2 layers) and its
    vocabulary, experts and top-k kept, as an HF directory with the demo's tokenizer (whose end-of-sequence id
    the config takes), with at least `positions` positions (the recipe's longest prompt + answer). Returns the
    directory."""
    shrunk = dict(hf)
    shrunk["max_position_embeddings"] = max(hf.get("max_position_embeddings", 0), positions)
    kv_heads = max(1, HEADS * hf.get("num_key_value_heads", hf["num_attention_heads"]) // hf["num_attention_heads"])
    shrunk.update(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=kv_heads,
        head_dim=HEAD_DIM,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        max_window_layers=LAYERS,
        use_sliding_window=False,
        torch_dtype="float32",
    )
    shrunk.pop("layer_types", None)  # per-layer lists of the full depth
    if hf.get("num_experts") or hf.get("num_local_experts"):
        shrunk.update(moe_intermediate_size=EXPERT_FFN, mlp_only_layers=[], decoder_sparse_step=1)
    tokenizer = json.loads((TOKENIZER_DIR / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        shrunk[key] = tokenizer.get(key)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(shrunk, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_DIR / name, out_dir / name)
    return out_dir


def rehearsal_overrides(
    counts: Counts,
    model_dir: Path,
    run_dir: Path,
    mean_len: float,
    steps: int,
    micro_batches: int,
    save: bool = True,
    expert_parallel: int = 1,
    engine_tp: int = 1,
    context_parallel: int = 1,
) -> list[str]:
    """What turns the recipe into the rehearsal (after the user's overrides of the recipe: command.py)."""
    return [
        # the stand-in engine and its rule (docs/engines.md); its log-probs are not the actor's
        "rollout.engine=synthetic",
        "algorithm.reward.verifier=synthetic",
        "algorithm.mismatch.guard=off",
        f"rollout.synthetic.mean_len_first={mean_len}",
        f"rollout.synthetic.mean_len_last={mean_len}",
        # what every CPU run of a recipe sets (shared with the recipes in miniature: miniature.py)
        *cpu_overrides(),
        # the shrunk model, one DP rank a process (one CP rank of one under context parallelism)
        f"model.hf_path={model_dir}",
        "model.init=random",
        "parallel.tensor_model_parallel_size=1",
        "parallel.pipeline_model_parallel_size=1",
        "parallel.virtual_pipeline_model_parallel_size=1",
        "parallel.sequence_parallel=false",
        f"parallel.expert_model_parallel_size={expert_parallel}",
        f"parallel.context_parallel_size={context_parallel}",
        f"rollout.engine_tp_size={engine_tp}",
        "rollout.offload_actor=false",
        # padded rows by token budget, as the GPU recipes' Transformer Engine runs `auto` (miniature.py
        # packing_on_its_device), for every recipe: the compute cut (trainer.rehearsal_micro_batches) cuts padded
        # rows only, packed ones are computed whole
        "trainer.packing=off",
        f"trainer.rehearsal_micro_batches={micro_batches}",
        # prompts from the built-in generator (short: the answers are what a step's tokens are)
        "data.source=arithmetic",
        f"trainer.steps={steps}",
        # one save at the end, resumed by a second launch
        f"logging.run_dir={run_dir}",
        f"checkpoint.dir={run_dir / 'checkpoints'}",
        f"checkpoint.save_interval={steps if save else 0}",
        "checkpoint.async_save=false",
        "checkpoint.keep_last=1",
        *counts.overrides(),
    ]


def threads_per_process(world: int, cores: int) -> int:
    return max(1, math.floor(cores / world))
