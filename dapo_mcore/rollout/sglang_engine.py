"""SGLang's offline Engine as a rollout engine: one engine per rank, weights pushed from tensors in buckets.

The Engine runs its scheduler in a child process; weights reach it through `update_weights_from_tensor`
(serialised per bucket, between `begin_weight_update()` and `end_weight_update()`, outside which SGLang
ignores them). On a GPU its memory saver frees the KV cache and weights while the actor trains
(`release_memory_occupation`) and takes them back before generation.

Only this module imports sglang (DESIGN.md: engines stay behind the adapter).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from dapo_mcore.data.types import routing_tensor
from dapo_mcore.rollout.base import (
    AnswerRequest,
    Completion,
    EngineSettings,
    OnFinished,
    RoutingUnavailable,
    SamplingParams,
    SleepState,
    answer_completion,
    request_seeds,
    routing_unavailable,
    step_poll,
)
from dapo_mcore.rollout.model_info import check_weight, hf_weight_shapes, stop_token_ids
from dapo_mcore.utils.errors import ConfigError


class SGLangEngine:
    name = "sglang"

    def __init__(self, engine, settings: EngineSettings):
        self.engine, self.settings = engine, settings
        self.on_cpu = settings.device == "cpu"
        self.stop_ids = stop_token_ids(settings.model_path, _tokenizer_eos(settings.model_path))
        self.shapes = hf_weight_shapes(settings.model_path)
        self.bucket_bytes = settings.weight_bucket_mb << 20
        # SGLang's memory saver needs CUDA; on the CPU release/resume would free nothing
        self.sleep = SleepState(not self.on_cpu and settings.sleep_level > 0, ("weights", "kv_cache", "cuda_graph"))
        # The same seed and weights give the same answers (deterministic inference, GPU only).
        self.seeded_sampling = not self.on_cpu
        self.tokenizer = engine.tokenizer_manager.tokenizer
        model_config = json.loads((Path(settings.model_path) / "config.json").read_text())
        self.n_layers, self.topk = model_config["num_hidden_layers"], model_config.get("num_experts_per_tok", 0)
        self._round = 0  # generate_answers' rounds: request ids unique in the engine

    @classmethod
    def create(cls, settings: EngineSettings) -> SGLangEngine:
        if settings.tp_size > 1:
            raise ConfigError(
                "rollout.engine=sglang runs one engine per rank (engine_tp_size=1) in this version; "
                "use rollout.engine=vllm for engine tensor parallelism inside the trainer"
            )
        import sglang

        return cls(sglang.Engine(**_engine_kwargs(settings)), settings)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        # One request per answer, each with its own seed (SGLang's seeded sampler draws the same tokens for
        # the same seed and position, so n copies of one request would all be alike); the radix cache still
        # computes each prompt once.
        inputs, sampling = [], []
        for ids, seed in zip(prompt_ids, request_seeds(params, len(prompt_ids))):
            for j in range(params.n):
                inputs.append(ids)
                sampling.append(self._sampling(params, params.max_new_tokens, seed + j))
        outputs = self.engine.generate(
            input_ids=inputs, sampling_params=sampling, return_logprob=True, **self._routing_request()
        )
        keep = params.keep_routing or (True,) * len(prompt_ids)
        completions = [self._completion(out, keep[k // params.n]) for k, out in enumerate(outputs)]
        return [completions[i * params.n : (i + 1) * params.n] for i in range(len(prompt_ids))]

    def _sampling(self, params: SamplingParams, max_new_tokens: int, seed: int) -> dict:
        return {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": -1,
            "max_new_tokens": max_new_tokens,
            "stop_token_ids": self.stop_ids,
            "sampling_seed": seed,
            "skip_special_tokens": True,
        }

    def generate_answers(
        self, requests: list[AnswerRequest], params: SamplingParams, on_finished: OnFinished
    ) -> list[Completion]:
        """The batch streamed (each chunk: what one request generated since its previous chunk, appended to what
        it had); once on_finished says stop, the unfinished requests are aborted and the stream read to its end,
        each aborted request's last chunk ending what it had generated."""
        self._round += 1
        rids = [f"dapo-{self._round}-{i}" for i in range(len(requests))]
        stream = self.engine.generate(
            input_ids=[r.prompt_ids + list(r.answer_prefix) for r in requests],
            sampling_params=[self._sampling(params, r.max_new_tokens, r.seed) for r in requests],
            return_logprob=True,
            stream=True,
            rid=rids,
            **self._routing_request(),
        )
        answers = StreamedAnswers(len(requests))
        tokens, logprobs = answers.tokens, answers.logprobs
        reasons: list[str | None] = [None] * len(requests)
        routed: list[torch.Tensor | None] = [None] * len(requests)
        stopped, poll = False, step_poll(on_finished)
        for chunk in stream:
            i, meta = answers.add(chunk), chunk["meta_info"]
            if not stopped and poll():  # a chunk stands for a step here (partial rollout runs at engine TP 1)
                stopped = True
                self._abort_unfinished(rids, reasons)
            if meta.get("finish_reason") is None or reasons[i] is not None:
                continue
            reasons[i] = _finish_reason(meta["finish_reason"], allow_abort=stopped)
            routed[i] = self._routed_experts(meta) if requests[i].keep_routing else None
            if not stopped and reasons[i] != "abort":
                answer = answer_completion(self.tokenizer, requests[i], tokens[i], logprobs[i], reasons[i], routed[i])
                stopped = bool(on_finished(i, answer))
                if stopped:
                    self._abort_unfinished(rids, reasons)
        return [
            answer_completion(self.tokenizer, r, t, lp, reason or "abort", routing)
            for r, t, lp, reason, routing in zip(requests, tokens, logprobs, reasons, routed)
        ]

    def _abort_unfinished(self, rids: list[str], reasons: list[str | None]) -> None:
        for rid, reason in zip(rids, reasons):
            if reason is None:
                self.engine.tokenizer_manager.abort_request(rid=rid)

    def _completion(self, out: dict, keep_routing: bool = True) -> Completion:
        meta = out["meta_info"]
        tokens = list(out["output_ids"])
        logprobs = [float(entry[0]) for entry in meta["output_token_logprobs"]]
        routed = self._routed_experts(meta) if keep_routing else None
        return Completion(tokens, logprobs, _finish_reason(meta["finish_reason"]), out["text"], routed)

    def _routing_request(self) -> dict:
        return {"return_routed_experts": True} if self.settings.return_routed_experts else {}

    def _routed_experts(self, meta: dict) -> torch.Tensor | None:
        """SGLang's routed experts of a finished request: base64 of int32 (token, layer, k) over the prompt and
        the output but its last token, as the engine contract's uint8 [rows, layers, k]."""
        encoded = meta.get("routed_experts")
        if encoded is None or not self.settings.return_routed_experts:
            return None
        flat = torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.int32)
        return routing_tensor(flat.view(-1, self.n_layers, self.topk))

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.sleep.wake(lambda tags: self.engine.resume_memory_occupation(tags=tags), only=("weights",))
        _ok(self.engine.begin_weight_update(), "begin_weight_update")
        try:
            for bucket in self._buckets(named_tensors):
                _ok(self.engine.update_weights_from_tensor(bucket, flush_cache=False), "update_weights_from_tensor")
        finally:
            _ok(self.engine.end_weight_update(), "end_weight_update")
        _ok(self.engine.flush_cache(), "flush_cache")  # cached prefixes were computed by the old weights

    def _buckets(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        bucket, size = [], 0
        for name, tensor in named_tensors:
            check_weight(self.name, self.shapes, name, tuple(tensor.shape))
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def release_memory(self) -> None:
        self.sleep.release(self.engine.release_memory_occupation)

    def resume_memory(self) -> None:
        self.sleep.wake(lambda tags: self.engine.resume_memory_occupation(tags=tags))

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


class StreamedAnswers:
    """The tokens and log-probs of each request of a streamed batch so far, grown by each chunk's new part.

    The engine streams incrementally (`incremental_streaming_output`): a chunk carries only what its request
    generated since its previous chunk, so reading the stream is linear in the answers' lengths. SGLang's default
    re-sends the whole output at every chunk (4 x 10^8 tokens and log-probs copied for one 20k-token answer)."""

    def __init__(self, n_requests: int):
        self.tokens: list[list[int]] = [[] for _ in range(n_requests)]
        self.logprobs: list[list[float]] = [[] for _ in range(n_requests)]

    def add(self, chunk: dict) -> int:
        """Appends the chunk's new tokens and log-probs to its request's; returns the request's index."""
        i = chunk["index"]
        new_tokens, new_logprobs = chunk_delta(chunk, len(self.tokens[i]))
        self.tokens[i] += new_tokens
        self.logprobs[i] += new_logprobs
        return i


def chunk_delta(chunk: dict, n_before: int) -> tuple[list[int], list[float]]:
    """The tokens and log-probs an incremental chunk adds to a request that had n_before tokens: at most
    completion_tokens - n_before of each (work proportional to that, not to the answer so far).

    meta_info's completion_tokens (the request's total) bounds what is new: SGLang's last chunk for a request aborted
    in its waiting queue repeats the last token and carries every log-prob; a log-prob may run one past the tokens
    (SGLang sends at least one per step); several chunks queued are joined into one (their deltas concatenated)."""
    meta = chunk["meta_info"]
    delta_ids = chunk.get("output_ids") or []
    n_new = max(0, meta.get("completion_tokens", n_before + len(delta_ids)) - n_before)
    new_tokens = list(delta_ids[:n_new])
    new_logprobs = [float(entry[0]) for entry in (meta.get("output_token_logprobs") or [])[:n_new]]
    return new_tokens, new_logprobs


def _finish_reason(reason: dict, allow_abort: bool = False) -> str:
    kind = reason["type"]
    if kind in ("stop", "length") or (kind == "abort" and allow_abort):
        return kind
    raise RuntimeError(f"SGLang ended a request with finish_reason={reason!r}")


def _ok(result, what: str) -> None:
    """SGLang reports a refused call as (False, message) rather than raising."""
    if isinstance(result, tuple) and result and result[0] is False:
        raise RuntimeError(f"SGLang {what} refused: {result[1] if len(result) > 1 else result}")


def _tokenizer_eos(model_path: str) -> int | None:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path).eos_token_id


def _kv_bytes_per_token(model_path: str, dtype: str) -> int:
    hf = json.loads((Path(model_path) / "config.json").read_text())
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    itemsize = torch.finfo(getattr(torch, dtype)).bits // 8
    return 2 * hf["num_hidden_layers"] * hf.get("num_key_value_heads", heads) * head_dim * itemsize


def _engine_kwargs(s: EngineSettings) -> dict:
    on_cpu = s.device == "cpu"
    kwargs = dict(
        model_path=s.model_path,
        device=s.device,
        dtype=s.dtype,
        random_seed=s.seed,
        load_format="auto" if s.load_weights else "dummy",
        disable_radix_cache=not s.enable_prefix_caching,
        disable_cuda_graph=on_cpu or not s.cuda_graphs,
        enable_memory_saver=not on_cpu and s.sleep_level > 0,
        # Per-request seeds (sampling_seed) are honoured only with deterministic inference on, which SGLang
        # offers on GPU attention backends only: on the CPU its answers are not reproducible by seed.
        enable_deterministic_inference=not on_cpu,
        # logging.engine_log: quiet, errors only; verbose, SGLang's default (its INFO lines)
        log_level="error" if s.engine_log == "quiet" else "info",
        # generate_answers' stream: each chunk only what is new (StreamedAnswers), linear in the answer's length
        incremental_streaming_output=True,
    )
    if s.return_routed_experts:  # the capture is allocated at start; each request then asks for its rows
        if problem := routing_unavailable("sglang", s.device):
            raise RoutingUnavailable(problem)
        kwargs["enable_return_routed_experts"] = True
    if on_cpu:  # a fraction would be of the host's memory: bound the KV pool in tokens instead
        # SGLang still checks the fraction: its KV budget is the host memory free after the load minus (1 -
        # fraction) of what was free before it, so other processes allocating during the load (a test suite's
        # other worker) must stay under the fraction. At 0.05 (1.2 GiB of 24) a suite run failed "Loaded weights
        # leave no GPU memory for the KV cache"; max_total_tokens caps the pool whatever the fraction.
        kwargs["mem_fraction_static"] = 0.3
        kwargs["max_total_tokens"] = (s.cpu_kv_cache_mb << 20) // _kv_bytes_per_token(s.model_path, s.dtype)
    else:
        kwargs["mem_fraction_static"] = s.memory_fraction
    if s.placement is not None and s.placement.device_index is not None:
        # SGLang puts TP shard i of an engine on GPU base_gpu_id + i * gpu_id_step; without it every task's
        # engine would start on GPU 0. One engine per task (engine TP 1): its task's own GPU.
        kwargs["base_gpu_id"] = s.placement.device_index
    if s.max_num_batched_tokens > 0:
        kwargs["chunked_prefill_size"] = s.max_num_batched_tokens
    if s.max_model_len > 0:
        kwargs["context_length"] = s.max_model_len
    return kwargs
