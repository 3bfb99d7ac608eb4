"""Helpers shared by the test tiers: tiny random HF models of each family, deterministic sample batches."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from dapo_mcore.data.tokenizer import build_char_tokenizer
from dapo_mcore.data.types import Group, Sample, group_to_dict

VOCAB = 100  # the shipped char tokenizer's size


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


# The tiny Qwen3-MoE: 4 experts of width 32, top-2 renormalised (as Qwen3-30B-A3B), layer 1 dense.
MOE_FIELDS = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1]
)


def tiny_hf_config(family: str, tie: bool = False, layers: int = 2):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "llama":
        return LlamaConfig(**common)
    if family == "llama3":  # Llama 3.1-style RoPE scaling with a large base
        return LlamaConfig(
            rope_scaling={**LLAMA3_ROPE, "rope_theta": 500000.0},
            rope_theta=500000.0,
            **{**common, "max_position_embeddings": 16384},
        )
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "qwen3":
        return Qwen3Config(head_dim=16, **common)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(head_dim=16, **MOE_FIELDS, **common)
    raise ValueError(family)


def save_tiny_model(
    out: Path, family: str, tie: bool = False, seed: int = 0, layers: int = 2, dtype: torch.dtype = torch.float32
) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(family, tie, layers))
    with torch.no_grad():  # HF zero-initialises norms and biases; make them matter in parity checks
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                param.add_(0.1 * torch.randn_like(param))
    model.to(dtype).save_pretrained(out)
    build_char_tokenizer(out)
    return out


def random_samples(n: int, seed: int = 0, max_prompt: int = 9, max_response: int = 12) -> list[Sample]:
    """Samples with random prompts/responses, advantages of both signs, old log-probs near the policy's."""
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        prompt = [rng.randrange(4, VOCAB) for _ in range(rng.randint(2, max_prompt))]
        response = [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, max_response))]
        samples.append(
            Sample(
                prompt_ids=prompt,
                response_ids=response,
                rollout_logprobs=[-4.6] * len(response),
                finish_reason="stop",
                advantage=rng.uniform(-1.5, 1.5),
                trainable=(i % 7 != 3),
                # log-probs of a uniform policy over 100 tokens, shifted so some ratios leave the clip range
                old_logprobs=[-4.6 + rng.uniform(-0.4, 0.4) for _ in response],
            )
        )
    return samples


def group_as_lists(group: Group) -> dict:
    """A group as saved (group_to_dict), its tensors as lists: comparable with == (a tensor's == is per element)."""
    saved = group_to_dict(group)
    return {**saved, "samples": [_tensors_as_lists(s) for s in saved["samples"]]}


def _tensors_as_lists(values: dict) -> dict:
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in values.items()}


# ---- a scripted rollout engine and test verifiers --------------------------------------------------------
class FakeTokenizer:
    class _Encoded:
        def __init__(self, ids):
            self.input_ids = ids

    def __call__(self, text):
        return self._Encoded([ord(c) for c in text])  # reversible: the scripted engine reads the prompt back


class LongTailEngine:
    """A decode loop in miniature for partial rollout: every answer's length and correctness are drawn when its
    first token is (the first token holds them: 2 x length + correct), so a continued answer ends as it would
    have in one go. All answers of a call advance one token per decode step; `answer(prompt_text, seed)` ->
    (length, correct) for a new answer. Counts decode steps and the answer slots they had."""

    def __init__(self, answer):
        self.answer, self.decode_steps, self.slot_steps, self.calls = answer, 0, 0, []

    def generate_answers(self, requests, params, on_finished):

        from dapo_mcore.rollout.base import step_poll

        self.calls.append(len(requests))
        poll = step_poll(on_finished)
        new = [[] for _ in requests]
        ended = [None] * len(requests)
        stopped = False
        while not stopped and None in ended:
            self.decode_steps += 1
            self.slot_steps += len(requests)
            for i, r in enumerate(requests):
                if ended[i] is not None:
                    continue
                tokens = list(r.answer_prefix) + new[i]
                if not tokens:
                    length, correct = self.answer("".join(chr(t) for t in r.prompt_ids), r.seed)
                    new[i].append(2 * length + int(correct))
                else:
                    new[i].append(5)
                length = (list(r.answer_prefix) + new[i])[0] // 2
                if len(r.answer_prefix) + len(new[i]) >= length or len(new[i]) >= r.max_new_tokens:
                    reason = "stop" if len(r.answer_prefix) + len(new[i]) >= length else "length"
                    ended[i] = reason
                    if not stopped:
                        stopped = bool(on_finished(i, self._completion(r, new[i], reason)))
            stopped = stopped or bool(poll())  # after each decode step, as the adapters do (rollout/base.py)
        return [self._completion(r, t, e or "abort") for r, t, e in zip(requests, new, ended)]

    def generate(self, prompt_ids, params):
        from dapo_mcore.rollout.base import AnswerRequest

        requests = [AnswerRequest(ids, params.max_new_tokens, params.seed + i * params.n + j)
                    for i, ids in enumerate(prompt_ids) for j in range(params.n)]  # fmt: skip
        out = self.generate_answers(requests, params, lambda i, c: False)
        return [out[i * params.n : (i + 1) * params.n] for i in range(len(prompt_ids))]

    @staticmethod
    def _completion(request, tokens, reason):
        from dapo_mcore.rollout.base import Completion

        text = "".join(chr(i) for i in request.prompt_ids)
        a, b = (int(x) for x in text.removeprefix("What is ").rstrip("?\n").split("+"))
        first = (list(request.answer_prefix) + tokens)[:1]
        answer = a + b if first and first[0] % 2 else a + b + 1
        return Completion(list(tokens), [-0.5] * len(tokens), reason, f"Answer: {answer}" if reason != "abort" else "")

    def update_weights(self, named_tensors):
        pass


class ScriptedEngine:
    """Answers each prompt n times; `correct(prompt_text, j)` decides whether answer j is right."""

    def __init__(self, correct, length=3):
        self.correct, self.length, self.calls = correct, length, []

    def generate(self, prompt_ids, params):
        from dapo_mcore.rollout.base import Completion

        self.calls.append(len(prompt_ids))
        out = []
        for ids in prompt_ids:
            text = "".join(chr(i) for i in ids)
            a, b = (int(x) for x in text.removeprefix("What is ").rstrip("?\n").split("+"))
            group = []
            for j in range(params.n):
                answer = a + b if self.correct(text, j) else a + b + 1
                group.append(
                    Completion(
                        token_ids=[5] * self.length,
                        logprobs=[-1.0] * self.length,
                        finish_reason="stop",
                        text=f"Answer: {answer}",
                    )
                )
            out.append(group)
        return out

    def update_weights(self, named_tensors):
        pass

    def release_memory(self):
        pass

    def resume_memory(self):
        pass

    def shutdown(self):
        pass
