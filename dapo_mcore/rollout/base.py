"""The engine interface every rollout adapter (hf, vllm, sglang) implements (DESIGN.md rule 5)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from dapo_mcore.config.schema import LoggingConfig, RolloutConfig
from dapo_mcore.data.types import TokenIds, Values
from dapo_mcore.rollout.placement import EnginePlacement
from dapo_mcore.utils.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    n: int
    # 0: greedy decoding (log-probs then at temperature 1).
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256
    # Seed of this request's sampling stream; the same seed and weights give the same responses.
    seed: int = 0
    # Per prompt: whether this rank keeps its answers' routing (None: every prompt's). A replica's engine-TP
    # ranks generate the same answers; each keeps the routing of the groups it sends (rollout/exchange.py).
    keep_routing: tuple[bool, ...] | None = None


_ROLLOUT = RolloutConfig()
_LOGGING = LoggingConfig()


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
    # Mixture-of-experts models: return the experts each token was routed to (Completion.routed_experts),
    # for routing replay and the routing-agreement metric. An engine that cannot raises RoutingUnavailable.
    return_routed_experts: bool = False
    # This task's place among the trainer's tasks (rollout/placement.py); None: a standalone engine (eval,
    # tests) in a process of its own, on the engine's default device.
    placement: EnginePlacement | None = None
    # "quiet": the engine logs errors only; "verbose": its own logging as it sets it up (logging.engine_log).
    engine_log: str = _LOGGING.engine_log
    # The name of what the engine holds host-wide (vLLM's shared memory between its TP ranks on the CPU): one per
    # run, the same in every attempt of it (run_instance_id), so that two runs on a host never share it and a
    # run's next attempt removes what a killed one left. "": one per process group (standalone engines).
    instance_id: str = ""


@dataclass
class Completion:
    # Lists, or 1-D int32 / float32 tensors (vLLM's adapter converts each answer as it ends), from an adapter;
    # tensors once rollout/guard.py has checked them (what the trainer gets from every engine).
    token_ids: TokenIds
    # log p(token) under the sampling distribution: log_softmax(logits / temperature), top-p not applied.
    logprobs: Values
    # "stop": ended with an end-of-sequence token (included in token_ids); "length": cut at max_new_tokens;
    # "abort": unfinished when its round was stopped (generate_answers), token_ids being what it had so far.
    finish_reason: str
    text: str
    # With EngineSettings.return_routed_experts: [rows, layers, top-k] uint8, the experts the engine's router
    # chose at every input token: the prompt's (and a continued answer's prefix), then the new tokens but the
    # last one (never fed back), rows = input tokens + new tokens - 1; one slice per HF layer, NO_EXPERT in
    # layers without a router (data/types.py). None: not asked for, or not known (an aborted answer).
    routed_experts: torch.Tensor | None = None
    # The engine's routing did not match the tokens and was dropped (rollout/guard.py).
    routing_dropped: bool = False


class RoutingUnavailable(ConfigError):
    """The engine cannot return the experts its router chose (routing replay needs them)."""


def routing_unavailable(engine: str, device: str) -> str | None:
    """Why `engine` on `device` cannot return routed experts; None when it can. vLLM returns them from its
    Model Runner V2 only (enable_return_routed_experts), which needs Triton: no CPU build has it. SGLang's
    capture buffer is host memory pinned through CUDA (its start fails on the CPU: measured)."""
    if not device.startswith("cpu"):
        return None
    if engine == "vllm":
        return (
            "vLLM's CPU build cannot return routed experts (its capture needs Model Runner V2, which needs "
            "Triton): use rollout.engine=hf on the CPU, or model.routing_replay=off"
        )
    if engine == "sglang":
        return (
            "SGLang cannot return routed experts on the CPU (its capture pins host memory through CUDA): use "
            "rollout.engine=hf on the CPU, or model.routing_replay=off"
        )
    return None


@dataclass(frozen=True)
class AnswerRequest:
    """One answer to generate, or to continue (partial rollout): the engine's input is prompt_ids followed by
    answer_prefix (the answer's tokens so far, generated by earlier weights); it generates at most
    max_new_tokens more. The completion holds the new tokens only, and the text of the whole answer."""

    prompt_ids: list[int]
    max_new_tokens: int
    seed: int
    answer_prefix: tuple[int, ...] = ()
    # False: the completion comes without routing (SamplingParams.keep_routing), never converted or held here
    keep_routing: bool = True


def answer_completion(
    tokenizer,
    request: AnswerRequest,
    tokens: list[int],
    logprobs: list[float],
    reason: str,
    routed_experts: torch.Tensor | None = None,
):
    """The completion of a request of generate_answers: its new tokens and their log-probs, and the text of the
    whole answer (the tokens it continued included)."""
    text = tokenizer.decode(list(request.answer_prefix) + list(tokens), skip_special_tokens=True)
    return Completion(list(tokens), list(logprobs), reason, text, routed_experts)


def routing_rows(request: AnswerRequest, n_new: int) -> int:
    """Rows of a completion's routed_experts: every input token, and every new token but the last."""
    return len(request.prompt_ids) + len(request.answer_prefix) + n_new - 1


# Told of each answer as it ends (its index in the request list; token_ids and text as in the final
# completion, log-probs possibly not yet filled in): True stops the round. An on_finished may also have a
# `poll()` method, which the adapter calls after each engine step (True stops the round at that step): how a
# round stops on other replicas' news, and how an engine's TP ranks stop at the same step
# (rollout/agreement.py RoundControl).
OnFinished = Callable[[int, Completion], bool]


def generate_by_answers(engine: RolloutEngine, prompt_ids: list[list[int]], params: SamplingParams):
    """`generate` for an engine whose unit is the answer: n requests per prompt (request i*n+j seeded
    params.seed + i*n + j), none stopped early, the completions grouped back by prompt."""
    keep = params.keep_routing or (True,) * len(prompt_ids)
    requests = [
        AnswerRequest(list(ids), params.max_new_tokens, params.seed + i * params.n + j, keep_routing=keep[i])
        for i, ids in enumerate(prompt_ids)
        for j in range(params.n)
    ]
    completions = engine.generate_answers(requests, params, lambda i, c: False)
    return [completions[i * params.n : (i + 1) * params.n] for i in range(len(prompt_ids))]


def step_poll(on_finished: OnFinished) -> Callable[[], bool]:
    """on_finished's poll(), or one that never stops the round."""
    return getattr(on_finished, "poll", None) or (lambda: False)


@runtime_checkable
class RolloutEngine(Protocol):
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """params.n completions for each prompt, in prompt order."""

    def generate_answers(
        self, requests: list[AnswerRequest], params: SamplingParams, on_finished: OnFinished
    ) -> list[Completion]:
        """One completion per request, in request order (params.n, max_new_tokens and seed are the requests').
        Once on_finished returns True the round stops: every answer still unfinished comes back with
        finish_reason "abort" and exactly the tokens and log-probs generated so far (possibly none)."""

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


def run_instance_id(run_dir: str | os.PathLike) -> str:
    """EngineSettings.instance_id of a run: from its run directory (two runs at once never share one: the run
    lock), so that every attempt of the run has the same."""
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()
    return f"dapo-{digest[:12]}"
