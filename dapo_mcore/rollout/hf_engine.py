"""A rollout engine on Hugging Face transformers: runs anywhere (CPU or GPU), slowly.

It is the reference adapter: the tiny CPU demo and the tests use it, and it receives the actor's weights
through the same HF-named export that vLLM and SGLang receive.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from contextlib import contextmanager, nullcontext

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from dapo_mcore.data.types import NO_EXPERT, ROUTING_DTYPE, routing_tensor
from dapo_mcore.rollout.base import (
    AnswerRequest,
    Completion,
    EngineSettings,
    OnFinished,
    SamplingParams,
    answer_completion,
    generate_by_answers,
    routing_rows,
    step_poll,
)
from dapo_mcore.rollout.model_info import check_weight, checkpoint_named_views

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFEngine:
    # The same seed and weights give the same answers.
    seeded_sampling = True
    name = "hf"

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        max_batch_rows: int = 256,
        stop_ids: list[int] | None = None,
        return_routed_experts: bool = False,
    ):
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.tokenizer = tokenizer
        self.max_batch_rows = max_batch_rows
        # Every end-of-sequence id the model declares; the tokenizer's alone when not given.
        self.stop_ids = stop_ids or [tokenizer.eos_token_id]
        self._shapes = {name: tuple(p.shape) for name, p in checkpoint_named_views(self.model).items()}
        self._routing = RoutingCapture(self.model) if return_routed_experts else None

    @classmethod
    def create(cls, settings: EngineSettings, max_batch_rows: int = 256) -> HFEngine:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from dapo_mcore.rollout.model_info import stop_token_ids

        path, dtype = settings.model_path, _DTYPES[settings.dtype]
        if settings.load_weights:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        else:  # weights arrive through update_weights before the first generate
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
        stop_ids = stop_token_ids(path, tokenizer.eos_token_id)
        return cls(model.to(settings.device), tokenizer, max_batch_rows, stop_ids, settings.return_routed_experts)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        # request i's seed is the seed of the batch chunk it starts (see _generate_rows)
        return generate_by_answers(self, prompt_ids, params)

    def generate_answers(
        self, requests: list[AnswerRequest], params: SamplingParams, on_finished: OnFinished
    ) -> list[Completion]:
        completions: list[Completion] = []
        stopper = None
        for start in range(0, len(requests), self.max_batch_rows):
            chunk = requests[start : start + self.max_batch_rows]
            if stopper is not None and stopper.stopped:  # the round was stopped in an earlier chunk
                completions += [answer_completion(self.tokenizer, r, [], [], "abort") for r in chunk]
                continue
            stopper = _RoundStopper(self, chunk, start, on_finished)
            completions += self._generate_rows(chunk, params, stopper)
        return completions

    @torch.no_grad()
    def _generate_rows(self, rows: list[AnswerRequest], params: SamplingParams, stopper: _RoundStopper) -> list:
        """One batch: the rows' inputs left-padded; one seed (the first row's) draws for all of them."""
        pad_id = self.tokenizer.pad_token_id
        if pad_id is None:
            pad_id = self.stop_ids[0]
        inputs = [r.prompt_ids + list(r.answer_prefix) for r in rows]
        width = max(len(ids) for ids in inputs)
        input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in inputs], device=self.device)
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in inputs], device=self.device)
        stopper.width = width
        with self._capturing(), torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(rows[0].seed)
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                **_decoding(params),
                max_new_tokens=max(r.max_new_tokens for r in rows),
                eos_token_id=self.stop_ids,
                pad_token_id=pad_id,
                stopping_criteria=StoppingCriteriaList([stopper]),
                output_logits=True,
                return_dict_in_generate=True,
            )
        new_tokens = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1).float() / (params.temperature or 1.0)
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        completions = []
        for i, request in enumerate(rows):
            length, reason = stopper.answer_end(i, new_tokens.shape[1])
            tokens, row_logprobs = new_tokens[i, :length].tolist(), logprobs[i, :length].tolist()
            routed = None
            if self._routing is not None and request.keep_routing:
                routed = self._routing.rows(i, len(rows), width - len(inputs[i]), routing_rows(request, length))
            completions.append(answer_completion(self.tokenizer, request, tokens, row_logprobs, reason, routed))
        return completions

    def _capturing(self):
        return self._routing.capturing() if self._routing else nullcontext()

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # Views taken now, not at start: release_memory / resume_memory move the model (Module.to gives every
        # parameter new storage), and a view taken before a move writes into the old storage, which the model
        # no longer reads (seen on an H200: the engine sampled from its initial weights, KL 0.41 nats a token).
        params = checkpoint_named_views(self.model)
        for name, tensor in named_tensors:
            check_weight(self.name, self._shapes, name, tuple(tensor.shape))
            param = params[name]
            param.copy_(tensor.to(device=param.device, dtype=param.dtype))

    def release_memory(self) -> None:
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def resume_memory(self) -> None:
        if self.device.type == "cuda":
            self.model.to(self.device)

    def shutdown(self) -> None:
        self.model = None


class RoutingCapture:
    """The experts a transformers MoE model's routers choose during one generate call, per answer.

    A forward hook on each router (`model.layers.N.mlp.gate`, whose output ends with the top-k expert ids
    [tokens, k]) keeps its ids: the first forward is the prefill of the left-padded batch [B * W, k], each
    later one a decoding step [B, k]. An answer's rows are its input tokens' prefill rows, then its decoding
    steps; the step after its end belongs to other rows' decoding and is not read."""

    _ROUTER = re.compile(r"model\.layers\.(\d+)\.mlp\.gate")

    def __init__(self, model: torch.nn.Module):
        config = model.config
        self.n_layers, self.topk = config.num_hidden_layers, config.num_experts_per_tok
        self.routers = [
            (int(match.group(1)), module)
            for name, module in model.named_modules()
            if (match := self._ROUTER.fullmatch(name))
        ]
        if not self.routers:
            raise ValueError(f"return_routed_experts: {type(model).__name__} has no mixture-of-experts router")
        self.calls: dict[int, list[torch.Tensor]] = {}

    @contextmanager
    def capturing(self):
        self.calls = {layer: [] for layer, _ in self.routers}
        handles = [router.register_forward_hook(self._hook(layer)) for layer, router in self.routers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, layer: int):
        def keep(_module, _inputs, output) -> None:
            self.calls[layer].append(output[-1].detach())  # (logits, scores, top-k ids): the ids [tokens, k]

        return keep

    def rows(self, i: int, batch: int, pad: int, n_rows: int) -> torch.Tensor:
        """[n_rows, layers, k] uint8 for row i of a batch of `batch` rows, its input left-padded by `pad`."""
        routed = torch.full((n_rows, self.n_layers, self.topk), NO_EXPERT, dtype=ROUTING_DTYPE)
        for layer, calls in self.calls.items():
            prefill_BWk = calls[0].view(batch, -1, self.topk)
            ids = torch.cat([prefill_BWk[i, pad:], *(step[i : i + 1] for step in calls[1:])])[:n_rows]
            if len(ids) < n_rows:  # transformers' decode loop ran otherwise than one forward per token
                raise RuntimeError(f"layer {layer}: {len(ids)} routed tokens captured for {n_rows} expected")
            routed[:, layer] = routing_tensor(ids.cpu())
        return routed


def _decoding(params: SamplingParams) -> dict:
    if params.temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": 0}


class _RoundStopper(StoppingCriteria):
    """Called by transformers' decode loop after each new token: ends each row at its own token budget (the
    loop knows only the longest), tells on_finished of each answer as it ends, and ends the whole batch once
    on_finished says stop. The rows left unfinished then are the round's aborted answers."""

    def __init__(self, engine: HFEngine, rows: list[AnswerRequest], first_index: int, on_finished: OnFinished):
        self.engine, self.rows, self.first_index, self.on_finished = engine, rows, first_index, on_finished
        self.width = 0  # the padded input width: new tokens start there
        self.ends: list[tuple[int, str] | None] = [None] * len(rows)  # (answer length, finish reason)
        self.stopped = False
        self.poll = step_poll(on_finished)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        new_tokens = input_ids[:, self.width :]
        n_new = new_tokens.shape[1]
        last = new_tokens[:, -1].tolist()  # one device->host copy a step, not one per row
        for i, request in enumerate(self.rows):
            if self.ends[i] is not None:
                continue
            if last[i] in self.engine.stop_ids:
                self.ends[i] = (n_new, "stop")
            elif n_new >= request.max_new_tokens:
                self.ends[i] = (n_new, "length")
            else:
                continue
            if not self.stopped:
                tokens = new_tokens[i].tolist()
                answer = answer_completion(self.engine.tokenizer, request, tokens, [], self.ends[i][1])
                self.stopped = bool(self.on_finished(self.first_index + i, answer))
        self.stopped = self.stopped or bool(self.poll())
        if self.stopped:
            return torch.ones(len(self.rows), dtype=torch.bool, device=input_ids.device)
        return torch.tensor([end is not None for end in self.ends], dtype=torch.bool, device=input_ids.device)

    def answer_end(self, i: int, n_new: int) -> tuple[int, str]:
        """Row i's answer length and finish reason, given the n_new tokens the loop kept (a loop that checks
        for the end a step late takes back the steps past it)."""
        end = self.ends[i]
        if end is not None and end[0] <= n_new:
            return end
        return n_new, "abort"
