"""The engine interface every rollout adapter (hf, vllm, sglang) implements (DESIGN.md rule 5)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class SamplingParams:
    n: int
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    # Seed of this request's sampling stream; the same seed and weights give the same responses.
    seed: int = 0


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
