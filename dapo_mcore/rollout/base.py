"""The engine interface every rollout adapter (hf, vllm, sglang) implements (DESIGN.md rule 5)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from dapo_mcore.config.schema import RolloutConfig
from dapo_mcore.rollout.placement import EnginePlacement


@dataclass(frozen=True)
class SamplingParams:
    n: int
    # 0: greedy decoding (log-probs then at temperature 1).
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    # Seed of this request's sampling stream; the same seed and weights give the same responses.
    seed: int = 0


_ROLLOUT = RolloutConfig()


@dataclass(frozen=True)
class EngineSettings:
    """What every adapter is built from (the trainer fills it from the `rollout` config section, whose defaults
    the knobs below take: one set of defaults, tests/unit/test_settings_defaults.py). Where the engine lives
    (model_path, device, dtype, load_weights, placement) the trainer resolves from the model and the tasks; the
    defaults here are a standalone engine's on the CPU (eval, tests)."""

    model_path: str
    device: str = "cpu"
    dtype: str = "float32"
    # False: the engine starts with placeholder weights; the actor's arrive through update_weights first.
    load_weights: bool = True
    # Engine tensor-parallel size (vLLM / SGLang); engine replicas = world size / tp_size.
    tp_size: int = _ROLLOUT.engine_tp_size
    # Fraction of accelerator memory the engine may take for weights + KV cache (vLLM gpu_memory_utilization,
    # SGLang mem_fraction_static).
    memory_fraction: float = _ROLLOUT.gpu_memory_utilization
    # KV cache of an engine on the CPU, in MiB (on the CPU a fraction would be of host memory).
    cpu_kv_cache_mb: int = _ROLLOUT.cpu_kv_cache_mb
    # Tokens one engine forward pass may batch (prefill chunks); 0: the engine's default.
    max_num_batched_tokens: int = _ROLLOUT.max_num_batched_tokens
    # Longest prompt + response the engine accepts; 0: the model's max_position_embeddings.
    max_model_len: int = _ROLLOUT.max_model_len
    enable_prefix_caching: bool = _ROLLOUT.enable_prefix_caching
    # CUDA graphs for decoding (GPU only; the CPU always runs eagerly).
    cuda_graphs: bool = _ROLLOUT.cuda_graphs
    # While the actor trains: vLLM sleep level 1 (weights to host, KV cache freed) or 2 (both freed; the
    # next push refreshes the weights anyway); 0 keeps everything resident.
    sleep_level: int = _ROLLOUT.sleep_level
    # Engine-wide seed; each request also carries its own (SamplingParams.seed).
    seed: int = _ROLLOUT.seed
    # Engines that receive weights through a serialising call (SGLang) send them in buckets of this size.
    weight_bucket_mb: int = _ROLLOUT.weight_bucket_mb
    # This task's place among the trainer's tasks (rollout/placement.py); None: a standalone engine (eval,
    # tests) in a process of its own, on the engine's default device.
    placement: EnginePlacement | None = None


@dataclass
class Completion:
    token_ids: list[int]
    # log p(token) under the sampling distribution: log_softmax(logits / temperature), top-p not applied.
    logprobs: list[float]
    # "stop": ended with an end-of-sequence token (included in token_ids); "length": cut at max_new_tokens.
    finish_reason: str
    text: str


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """params.n completions for each prompt, in prompt order."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named full tensors (e.g. 'model.layers.0.mlp.up_proj.weight'); unknown names are errors."""

    def release_memory(self) -> None:
        """Free accelerator memory (weights, KV cache) while the trainer runs."""

    def resume_memory(self) -> None:
        """Take the memory back before generating."""

    def shutdown(self) -> None: ...


class SleepState:
    """Which of an engine's memory pools are released while the actor trains, so that each is taken back
    exactly once: the weights when a push arrives, the rest (KV cache, graphs) before generating."""

    def __init__(self, enabled: bool, tags: tuple[str, ...]):
        self.enabled, self.tags = enabled, tags
        self.asleep: set[str] = set()

    def release(self, release_all: Callable[[], object]) -> None:
        if self.enabled and not self.asleep:
            release_all()
            self.asleep = set(self.tags)

    def wake(self, wake_tags: Callable[[list[str]], object], only: tuple[str, ...] | None = None) -> None:
        waking = self.asleep & set(only) if only else set(self.asleep)
        if waking:
            wake_tags(sorted(waking))
            self.asleep -= waking


def request_seeds(params: SamplingParams, n_prompts: int) -> list[int]:
    """One seed per prompt of a generate call: the same prompts, seed and weights give the same answers."""
    return [params.seed + i * params.n for i in range(n_prompts)]
