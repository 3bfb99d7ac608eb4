"""A rollout engine on Hugging Face transformers: runs anywhere (CPU or GPU), slowly.

It is the reference adapter: the tiny CPU demo and the tests use it, and it receives the actor's weights
through the same HF-named export that vLLM and SGLang receive.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from dapo_mcore.rollout.base import Completion, EngineSettings, SamplingParams
from dapo_mcore.rollout.model_info import check_weight

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFEngine:
    # The same seed and weights give the same answers.
    seeded_sampling = True
    name = "hf"

    def __init__(self, model: torch.nn.Module, tokenizer, max_batch_rows: int = 256, stop_ids: list[int] | None = None):
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.tokenizer = tokenizer
        self.max_batch_rows = max_batch_rows
        # Every end-of-sequence id the model declares; the tokenizer's alone when not given.
        self.stop_ids = stop_ids or [tokenizer.eos_token_id]
        self._params = dict(self.model.named_parameters())
        self._shapes = {name: tuple(p.shape) for name, p in self._params.items()}

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
        return cls(model.to(settings.device), tokenizer, max_batch_rows, stop_token_ids(path, tokenizer.eos_token_id))

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        rows = [ids for ids in prompt_ids for _ in range(params.n)]
        completions: list[Completion] = []
        for start in range(0, len(rows), self.max_batch_rows):
            chunk = rows[start : start + self.max_batch_rows]
            completions += self._generate_rows(chunk, params, seed=params.seed + start)
        return [completions[i * params.n : (i + 1) * params.n] for i in range(len(prompt_ids))]

    @torch.no_grad()
    def _generate_rows(self, rows: list[list[int]], params: SamplingParams, seed: int) -> list[Completion]:
        pad_id = self.tokenizer.pad_token_id
        if pad_id is None:
            pad_id = self.stop_ids[0]
        width = max(len(r) for r in rows)
        input_ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=self.device)
        attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                **_decoding(params),
                max_new_tokens=params.max_new_tokens,
                eos_token_id=self.stop_ids,
                pad_token_id=pad_id,
                output_logits=True,
                return_dict_in_generate=True,
            )
        new_tokens = out.sequences[:, width:]
        logits = torch.stack(out.logits, dim=1).float() / (params.temperature or 1.0)
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        return [self._completion(new_tokens[i].tolist(), logprobs[i].tolist()) for i in range(len(rows))]

    def _completion(self, tokens: list[int], logprobs: list[float]) -> Completion:
        stops = [i for i, token in enumerate(tokens) if token in self.stop_ids]
        if stops:  # the first end-of-sequence token ends the answer (it is kept); the rest is padding
            cut = stops[0] + 1
            tokens, logprobs, reason = tokens[:cut], logprobs[:cut], "stop"
        else:
            reason = "length"
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return Completion(token_ids=tokens, logprobs=logprobs, finish_reason=reason, text=text)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named_tensors:
            check_weight(self.name, self._shapes, name, tuple(tensor.shape))
            param = self._params[name]
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
        self._params = {}


def _decoding(params: SamplingParams) -> dict:
    if params.temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": 0}
