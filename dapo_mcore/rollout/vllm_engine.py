"""vLLM inside the training processes: one engine replica per `tp_size` ranks, weights pushed in place.

The engine runs in-process (V1 multiprocessing off). Inside the trainer it uses vLLM's `external_launcher`
executor, made for SPMD programs like this one, at every engine TP size: it puts each task's shard on GPU
LOCAL_RANK (rollout/placement.py), and every rank of an engine group builds the same LLM, makes the same
generate calls and gets the same answers. (On the CPU, at engine TP 1, the default executor.) Weights come
from the actor as HF-named tensors and go through vLLM's in-place reload (`collective_rpc("reload_weights")`),
which maps names (fused QKV, gate/up) and repacks for its kernels, as loading from disk would: no file is
written.

Only this module imports vllm (DESIGN.md: engines stay behind the adapter).
"""

from __future__ import annotations

import logging
import os
import warnings
from array import array
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from dapo_mcore.data.types import NO_EXPERT, routing_tensor
from dapo_mcore.rollout.base import (
    AnswerRequest,
    Completion,
    EngineSettings,
    OnFinished,
    RoutingUnavailable,
    SamplingParams,
    SleepState,
    generate_by_answers,
    routing_unavailable,
    step_poll,
)
from dapo_mcore.rollout.model_info import check_weight, hf_weight_shapes, stop_token_ids
from dapo_mcore.rollout.vllm_compat import (
    engine_log_kwargs,
    logging_during_import,
    name_cpu_shared_memory,
    prepare_environment,
    process_group_instance_id,
    remove_shared_memory,
    track_broadcast_shared_memory,
)

# vLLM reads these when it is imported and when the LLM starts; set before either happens.
_ENV_DEFAULTS = {
    # The engine lives in this process: no engine-core subprocess to die unseen or to leak.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # On the CPU, vLLM pins its OpenMP threads to cores; the actor shares this process and needs them too.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}


class VLLMEngine:
    # The same seed and weights give the same answers.
    seeded_sampling = True
    name = "vllm"

    def __init__(self, llm, settings: EngineSettings):
        self.llm, self.settings = llm, settings
        self.on_cpu = settings.device == "cpu"
        self.tokenizer = llm.get_tokenizer()
        self.stop_ids = stop_token_ids(settings.model_path, self.tokenizer.eos_token_id)
        self.shapes = hf_weight_shapes(settings.model_path)
        # vLLM's sleep mode frees nothing on the CPU
        self.sleep = SleepState(not self.on_cpu and settings.sleep_level > 0, ("weights", "kv_cache"))
        self._round = 0  # generate_answers' rounds: request ids unique in the engine

    @classmethod
    def create(cls, settings: EngineSettings) -> VLLMEngine:
        for key, value in _ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        # vLLM drops torch to one thread unless OMP_NUM_THREADS is set, and on the CPU replaces
        # torch.set_num_threads for the whole process: keep the actor's threads as they are.
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        set_num_threads = torch.set_num_threads
        _check_local_rank(settings)
        prepare_environment(on_cuda=settings.device != "cpu")
        _quiet_vllm_import(settings.engine_log)
        with logging_during_import(_vllm_log_level(settings.engine_log)):
            from vllm import LLM
        instance_id = settings.instance_id or process_group_instance_id()
        track_broadcast_shared_memory(instance_id)
        if settings.device == "cpu":
            name_cpu_shared_memory(instance_id)

        try:
            # vLLM seeds the global RNGs when it starts; the actor's random streams must not move.
            with torch.random.fork_rng(devices=[]):
                llm = LLM(**_llm_kwargs(settings))
        except BaseException:
            _forget_groups()
            raise
        finally:
            torch.set_num_threads = set_num_threads
        return cls(llm, settings)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        # n requests a prompt, request j seeded seed + j as vLLM seeds a request's n answers (parallel_sampling):
        # the same answers as LLM.generate's, each converted as it ends, where LLM.generate keeps every vLLM
        # output of the call until its last answer ends
        return generate_by_answers(self, prompt_ids, params)

    def _sampling(self, params: SamplingParams, max_new_tokens: int, seed: int, **extra):
        from vllm import SamplingParams as VSamplingParams

        return VSamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=-1,
            max_tokens=max_new_tokens,
            stop_token_ids=self.stop_ids,
            logprobs=0,  # the sampled token's log-prob only
            # vLLM keeps a live request's log-probs in a few flat lists, not a dict and a Logprob a token
            flat_logprobs=True,
            # no text, nor a decoded string a log-prob, built token by token: each answer's text is decoded
            # once as it ends (_RoundAnswers)
            detokenize=False,
            seed=seed,
            **extra,
        )

    def generate_answers(
        self, requests: list[AnswerRequest], params: SamplingParams, on_finished: OnFinished
    ) -> list[Completion]:
        """vLLM's own step loop (what LLM.generate runs), each request streaming its new tokens (DELTA
        outputs); once on_finished says stop, the unfinished requests are aborted in the engine."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine, self._round = self.llm.llm_engine, self._round + 1
        ids = [f"dapo-{self._round}-{i}" for i in range(len(requests))]
        for request_id, r in zip(ids, requests):
            sampling = self._sampling(params, r.max_new_tokens, r.seed, output_kind=RequestOutputKind.DELTA)
            engine.add_request(
                request_id, TokensPrompt(prompt_token_ids=r.prompt_ids + list(r.answer_prefix)), sampling
            )
        answers, stopped, poll = _RoundAnswers(self.tokenizer, requests, ids), False, step_poll(on_finished)
        try:
            while not stopped and engine.has_unfinished_requests():
                for i, answer in answers.take(engine.step()):  # the answers that ended at this step
                    if not stopped:  # the answers ending in the same step are kept, untold
                        stopped = bool(on_finished(i, answer))
                stopped = stopped or bool(poll())  # every TP rank polls after the same steps
        finally:  # stopped, or failed: nothing of this round may stay in the engine
            unfinished = answers.unfinished()
            if unfinished:
                engine.abort_request(unfinished)
        return answers.completions()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.sleep.wake(lambda tags: self.llm.wake_up(tags=tags), only=("weights",))  # KV cache: at resume
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": self._checked(named_tensors)})
        if self.on_cpu:
            self.llm.collective_rpc(_repack_tied_lm_head)
        self.llm.reset_prefix_cache()  # cached prefixes were computed by the old weights

    def _checked(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            check_weight(self.name, self.shapes, name, tensor.shape)
            yield name, tensor

    def release_memory(self) -> None:
        self.sleep.release(lambda: self.llm.sleep(level=self.settings.sleep_level))

    def resume_memory(self) -> None:
        self.sleep.wake(lambda tags: self.llm.wake_up(tags=tags))

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            remove_shared_memory()


class _RoundAnswers:
    """A round's answers as vLLM streams them (DELTA outputs). A live answer's tokens and sampled log-probs go to
    4-byte arrays; as it ends it becomes its Completion (int32 / float32 tensors, its text decoded once), so that
    nothing of vLLM's outputs is kept past the step that brought it: at the paper's scale (8,192 answers of up to
    20k tokens a round, on every TP rank of an engine) vLLM's per-token objects would be tens of GB a node."""

    def __init__(self, tokenizer, requests: list[AnswerRequest], request_ids: list[str]):
        self.tokenizer, self.requests, self.request_ids = tokenizer, requests, request_ids
        self.index = {request_id: i for i, request_id in enumerate(request_ids)}
        self.live = {i: (array("i"), array("f")) for i in range(len(requests))}
        self.done: list[Completion | None] = [None] * len(requests)

    def take(self, outputs) -> Iterator[tuple[int, Completion]]:
        """Appends each output's new tokens; yields (index, completion) of each answer that ended. A generator,
        so that no output stays referenced once the step's are read."""
        for out in outputs:
            i, delta = self.index[out.request_id], out.outputs[0]
            tokens, logprobs = self.live[i]
            tokens.extend(delta.token_ids)
            logprobs.extend(_sampled_logprobs(delta.logprobs, delta.token_ids))
            if out.finished:  # the routing arrives whole with the last delta
                routed = _routed_experts(delta) if self.requests[i].keep_routing else None
                self.done[i] = self._completion(i, _finish_reason(delta.finish_reason), routed)
                yield i, self.done[i]

    def unfinished(self) -> list[str]:
        return [self.request_ids[i] for i in self.live]

    def completions(self) -> list[Completion]:
        """Every request's completion: the unfinished ones (a stopped round) as aborted with their tokens so far."""
        return [self.done[i] or self._completion(i, "abort", None) for i in range(len(self.requests))]

    def _completion(self, i: int, reason: str, routed: torch.Tensor | None) -> Completion:
        tokens, logprobs = self.live.pop(i)
        # the whole answer's text: a continued answer's earlier tokens too
        text = self.tokenizer.decode([*self.requests[i].answer_prefix, *tokens], skip_special_tokens=True)
        return Completion(_tensor(tokens), _tensor(logprobs), reason, text, routed)


def _tensor(values: array) -> torch.Tensor:
    """An array's values as a tensor of its type (i: int32, f: float32), copied out of its buffer (which may grow
    no more once it is shared; np.array takes an empty one too, torch.frombuffer does not)."""
    return torch.from_numpy(np.array(values))


def _sampled_logprobs(logprobs, token_ids: list[int]) -> list[float]:
    """The sampled tokens' log-probs of a delta. At logprobs=0 vLLM's FlatLogprobs holds one entry a position, the
    sampled token's, in plain lists: read them there rather than through a dict and a Logprob built per token;
    a list of dicts (a vLLM that ignores flat_logprobs) is read per token."""
    if getattr(logprobs, "token_ids", None) == list(token_ids):
        return logprobs.logprobs
    return [step[token].logprob for step, token in zip(logprobs, token_ids)]


def _routed_experts(out) -> torch.Tensor | None:
    """vLLM's routed experts of a finished answer ([prompt + new tokens - 1, layers, k], uint8, or uint16 past 256
    experts; zeros in dense layers) as the engine contract's uint8; None when not asked for. vLLM's uint8 array is
    its own (concatenated for this answer) and is taken as it is: 384 bytes a token at 30B-A3B, which a widening
    to int64 would make 3 kB."""
    routed = getattr(out, "routed_experts", None)
    if routed is None:
        return None
    experts = np.asarray(routed)
    if experts.dtype.kind != "u":  # signed: negative ids mean none (routing_tensor maps them)
        return routing_tensor(torch.from_numpy(experts))
    if experts.size and int(experts.max()) >= NO_EXPERT:
        raise ValueError(f"expert id {int(experts.max())} does not fit the routing's uint8 (ids 0-{NO_EXPERT - 1})")
    return torch.from_numpy(experts.astype(np.uint8, copy=False))


def _finish_reason(reason: str | None) -> str:
    if reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM ended a request with finish_reason={reason!r}")
    return reason


def _llm_kwargs(s: EngineSettings) -> dict:
    on_cpu = s.device == "cpu"
    kwargs = dict(
        model=s.model_path,
        dtype=s.dtype,
        seed=s.seed,
        load_format="auto" if s.load_weights else "dummy",
        tensor_parallel_size=s.tp_size,
        enable_prefix_caching=s.enable_prefix_caching,
        # Log-probs after temperature (and top-p): the distribution the tokens were drawn from, as the
        # actor's log-probs are computed at the same temperature.
        logprobs_mode="processed_logprobs",
        enforce_eager=on_cpu or not s.cuda_graphs,
        enable_sleep_mode=not on_cpu and s.sleep_level > 0,
        disable_log_stats=True,
        **engine_log_kwargs(_vllm_log_level(s.engine_log)),
    )
    if s.tp_size > 1 or (s.placement is not None and not on_cpu):
        # Every task of the trainer builds its own LLM (SPMD). vLLM's default in-process executor puts the
        # engine on GPU 0 whatever the task; external_launcher takes the task's RANK and LOCAL_RANK from the
        # environment and runs its shard on GPU LOCAL_RANK (the placement's device_index), at every TP size.
        # No data_parallel_size: the world's ranks beyond one TP group are vLLM's "external DP" replicas,
        # each generating on its own (a DP size would join all replicas' steps in lockstep, so one replica
        # with fewer generate calls than the others would hang them).
        kwargs["distributed_executor_backend"] = "external_launcher"
    if on_cpu:  # a fraction would be of the host's memory: give the KV cache a size instead
        kwargs["kv_cache_memory_bytes"] = s.cpu_kv_cache_mb << 20
        # A seeded request whose prompt is prefilled in parts makes vLLM rewind its generator with
        # Generator.set_offset, which CPU generators lack ("CPU Generator does not use offset"): prefill
        # whole prompts only.
        kwargs["enable_chunked_prefill"] = False
    else:
        kwargs["gpu_memory_utilization"] = s.memory_fraction
    if s.return_routed_experts:
        problem = routing_unavailable("vllm", s.device)
        if problem:
            raise RoutingUnavailable(problem)
        # vLLM keeps the routing of cached prefixes by block hash: its capture requires prefix caching
        kwargs.update(enable_return_routed_experts=True, enable_prefix_caching=True)
    if s.max_num_batched_tokens > 0:
        kwargs["max_num_batched_tokens"] = s.max_num_batched_tokens
    if s.max_model_len > 0:
        kwargs["max_model_len"] = s.max_model_len
    return kwargs


def _check_local_rank(s: EngineSettings) -> None:
    """external_launcher reads LOCAL_RANK itself: it must name the device the placement chose."""
    p = s.placement
    if p is not None and p.device_index is not None and os.environ.get("LOCAL_RANK") != str(p.device_index):
        raise RuntimeError(
            f"the vLLM engine of rank {p.rank} belongs on cuda:{p.device_index}, but LOCAL_RANK="
            f"{os.environ.get('LOCAL_RANK', 'unset')} would put it elsewhere"
        )


def _repack_tied_lm_head(worker) -> None:
    """On the CPU, vLLM runs each linear layer through a kernel handle packed from its weight when the layer is
    processed. A reload re-processes the layers it loads, but a tied LM head receives no weight of its own (it
    shares the embedding's), so it would keep multiplying by the weights it was first packed from: repack it."""
    model = worker.get_model()
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is not None and embed is not None and head.weight is embed.weight:
        head.quant_method.process_weights_after_loading(head)


def _vllm_log_level(engine_log: str) -> str:
    """logging.engine_log=quiet: vLLM logs errors only (its INFO lines, and its warnings about settings this
    adapter chose, e.g. chunked prefill off or eager mode, are no news to a user); verbose: vLLM's default
    (INFO). VLLM_LOGGING_LEVEL, when set, wins either way (upper-cased: vLLM 0.32+ refuses "debug")."""
    return (os.environ.get("VLLM_LOGGING_LEVEL") or ("ERROR" if engine_log == "quiet" else "INFO")).upper()


def _quiet_vllm_import(engine_log: str) -> None:
    """Before vLLM is imported: lines it logs while importing, before its logging is set up (LLM's log_level
    sets it up for the engine), follow the same level; deprecation warnings raised in vLLM's code are not the
    user's to act on (quiet only). One misleading line is dropped in both modes (_HarmlessReloadWarning)."""
    logging.getLogger("vllm").setLevel(_vllm_log_level(engine_log))
    if engine_log == "quiet":
        for category in (DeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", category=category, module=r"vllm\.")
    reload_logger = logging.getLogger(_RELOAD_LOGGER)
    if not any(isinstance(f, _HarmlessReloadWarning) for f in reload_logger.filters):
        reload_logger.addFilter(_HarmlessReloadWarning())


_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"  # vLLM's in-place weight reload


class _HarmlessReloadWarning(logging.Filter):
    """vLLM's in-place reload (every weight push) warns "RotaryEmbedding: Failed to load weights": the rotary
    layer's cos/sin table is a buffer vLLM computes from the config, which no checkpoint (and no push) holds,
    and the reload puts the table it had back. The pushed weights themselves are checked (weight_sync/verify.py,
    tests/engines/test_engine_contract.py). Other layers' failures still show (at engine_log=verbose)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args == ("RotaryEmbedding",))


def _forget_groups() -> None:
    """After a failed start: drop the process groups vLLM registered, so that a later engine in this process
    starts clean (the default group is the trainer's and stays)."""
    from vllm.distributed import parallel_state

    parallel_state.destroy_model_parallel()
    if parallel_state._WORLD is not None:
        parallel_state._WORLD.destroy()
        parallel_state._WORLD = None
