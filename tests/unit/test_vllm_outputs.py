"""The vLLM adapter holds a round's answers compactly (rollout/vllm_engine.py): each answer is converted as it ends
(int32 tokens, float32 log-probs, its text decoded once by the tokenizer), no vLLM output object of it outlives the
engine step it ended in, vLLM is asked for flat log-probs and no detokenizing, and routing stays uint8.

vLLM's engine is faked at the calls the adapter makes (add_request, step, abort_request, has_unfinished_requests,
and LLM.generate as vLLM runs it: its outputs kept until every answer has ended); the log-prob containers are
vLLM's own, built as its output processor builds them."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from vllm.logprobs import append_logprobs_for_next_position, create_sample_logprobs  # noqa: E402
from vllm.sampling_params import RequestOutputKind  # noqa: E402

from dapo_mcore.rollout.base import AnswerRequest, EngineSettings, SamplingParams  # noqa: E402
from dapo_mcore.rollout.vllm_engine import VLLMEngine, _routed_experts  # noqa: E402
from tests.conftest import REPO  # noqa: E402

MODEL = REPO / "examples/models/tiny-arith"
EOS = 2  # tiny-arith's
# The answers the fake engine streams, one token a step, to its requests in the order they are added.
ANSWERS = [([11, 12], "length"), ([21, 22, 23, EOS], "stop"), ([31, 32, 33, 34, 35], "length")]


def logprob(token: int, position: int) -> float:
    return -(token + position) / 64  # exact in float32


def piece(token: int) -> str:
    return "" if token == EOS else f"<{token}>"


class Tokenizer:
    """The tokenizer's decode, counted."""

    eos_token_id = EOS

    def __init__(self):
        self.decoded: list[list[int]] = []

    def decode(self, ids, skip_special_tokens: bool) -> str:
        self.decoded.append([int(t) for t in ids])
        return "".join(piece(int(t)) for t in ids)


class Positions(list):
    """vLLM's list-of-dicts log-probs (a list: weak references need a subclass)."""


class CompletionOutput:
    def __init__(self, token_ids, logprobs, finish_reason, text):
        self.token_ids, self.logprobs, self.finish_reason, self.text = token_ids, logprobs, finish_reason, text


class RequestOutput:
    def __init__(self, request_id, completion, finished):
        self.request_id, self.outputs, self.finished = request_id, [completion], finished


class Engine:
    """vLLM's engine at the calls the adapter makes. At each step it notes every output object of an answer that
    ended at an earlier step and is still alive (`kept`). honours_flat=False: a vLLM that ignores flat_logprobs."""

    def __init__(self, honours_flat: bool):
        self.honours_flat = honours_flat
        self.params, self.live, self.aborted = [], {}, []
        self.ended: list[weakref.ref] = []
        self.kept: list[str] = []

    def add_request(self, request_id, prompt, params):
        assert params.n == 1
        self.live[request_id] = (*ANSWERS[len(self.params) % len(ANSWERS)], params, 0)
        self.params.append(params)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def abort_request(self, request_ids):
        self.aborted += request_ids
        for request_id in request_ids:
            del self.live[request_id]

    def step(self) -> list[RequestOutput]:
        self.kept += [type(obj).__name__ for obj in (ref() for ref in self.ended) if obj is not None]
        outputs = []
        for request_id, (tokens, reason, params, n) in list(self.live.items()):
            n, finished, delta = n + 1, n + 1 == len(tokens), params.output_kind == RequestOutputKind.DELTA
            self.live[request_id] = (tokens, reason, params, n)
            if finished:
                del self.live[request_id]
            if delta or finished:  # FINAL_ONLY: the whole answer once it has ended
                out = self.output(request_id, tokens, n - 1 if delta else 0, n, reason if finished else None, params)
                outputs.append(out)
                if finished:
                    self.ended += [weakref.ref(obj) for obj in self.objects(out)]
        return outputs

    def output(self, request_id, tokens, start, end, reason, params) -> RequestOutput:
        flat = params.flat_logprobs and self.honours_flat
        logprobs = create_sample_logprobs(flat) if flat else Positions()
        for position in range(start, end):  # as vLLM's LogprobsProcessor appends a position
            decoded = [piece(tokens[position])] if params.detokenize else [None]
            token = tokens[position]
            append_logprobs_for_next_position(logprobs, [token], [logprob(token, position)], decoded, 1, 0)
        text = "".join(piece(t) for t in tokens[start:end]) if params.detokenize else ""
        completion = CompletionOutput(tokens[start:end], logprobs, reason, text)
        return RequestOutput(request_id, completion, reason is not None)

    @staticmethod
    def objects(out: RequestOutput) -> list:
        logprobs = out.outputs[0].logprobs
        per_token = [entry for step in logprobs for entry in step.values()] if isinstance(logprobs, Positions) else []
        return [out, out.outputs[0], logprobs, *per_token]


class LLM:
    """vLLM's LLM: LLM.generate adds FINAL_ONLY requests and returns their outputs once all have ended."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer):
        self.llm_engine, self.tokenizer = engine, tokenizer

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def generate(self, prompts, params, use_tqdm=False):
        for k, (prompt, p) in enumerate(zip(prompts, params)):
            p.output_kind = RequestOutputKind.FINAL_ONLY
            self.llm_engine.add_request(str(k), prompt, p)
        ended = []
        while self.llm_engine.has_unfinished_requests():
            ended += [out for out in self.llm_engine.step() if out.finished]
        return sorted(ended, key=lambda out: int(out.request_id))


def fake_engine(honours_flat: bool = True) -> tuple[VLLMEngine, Engine, Tokenizer]:
    engine, tokenizer = Engine(honours_flat), Tokenizer()
    return VLLMEngine(LLM(engine, tokenizer), EngineSettings(str(MODEL))), engine, tokenizer


def expected(k: int, n: int | None = None) -> tuple[list[int], list[float], str]:
    tokens = ANSWERS[k % len(ANSWERS)][0][:n]
    return tokens, [logprob(t, p) for p, t in enumerate(tokens)], "".join(piece(t) for t in tokens)


def check_answer(completion, k: int, reason: str, n: int | None = None) -> None:
    tokens, logprobs, text = expected(k, n)
    assert completion.token_ids.dtype == torch.int32 and completion.token_ids.tolist() == tokens
    assert completion.logprobs.dtype == torch.float32 and completion.logprobs.tolist() == logprobs
    assert (completion.finish_reason, completion.text) == (reason, text)


@pytest.mark.parametrize("honours_flat", [True, False], ids=["flat", "dicts"])
@pytest.mark.parametrize("call", ["generate", "generate_answers"])
def test_each_answer_is_converted_as_it_ends_and_no_vllm_output_of_it_is_kept(call, honours_flat):
    adapter, engine, tokenizer = fake_engine(honours_flat)
    prompts = [[5, 6], [7], [8, 9, 10]]
    if call == "generate":
        completions = [group[0] for group in adapter.generate(prompts, SamplingParams(n=1, max_new_tokens=8))]
    else:
        requests = [AnswerRequest(p, 8, seed=k) for k, p in enumerate(prompts)]
        completions = adapter.generate_answers(requests, SamplingParams(n=1), lambda i, c: False)
    for k, c in enumerate(completions):
        check_answer(c, k, ANSWERS[k][1])
    assert engine.kept == []  # nothing of an ended answer lived into a later step
    assert all(p.detokenize is False and p.flat_logprobs is True for p in engine.params)
    assert sorted(tokenizer.decoded) == sorted(expected(k)[0] for k in range(len(prompts)))  # once an answer


def test_a_stopped_round_converts_each_unfinished_answer_once_with_its_tokens_so_far():
    adapter, engine, tokenizer = fake_engine()
    requests = [AnswerRequest([5], 8, seed=k) for k in range(3)]
    told = []
    out = adapter.generate_answers(requests, SamplingParams(n=1), lambda i, c: told.append(i) or True)
    assert told == [0] and engine.aborted == ["dapo-1-1", "dapo-1-2"]
    check_answer(out[0], 0, "length")
    check_answer(out[1], 1, "abort", n=2)
    check_answer(out[2], 2, "abort", n=2)
    assert len(tokenizer.decoded) == 3 and engine.kept == []


def test_routing_stays_uint8_without_a_widening_copy():
    class Delta:
        def __init__(self, routed):
            self.routed_experts = routed

    routed = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    got = _routed_experts(Delta(routed))
    assert got.dtype == torch.uint8 and np.shares_memory(got.numpy(), routed)  # vLLM's own array, not a copy
    wide = routed.astype(np.uint16)  # vLLM's capture dtype for more than 256 experts
    assert torch.equal(_routed_experts(Delta(wide)), torch.from_numpy(routed))
    with pytest.raises(ValueError, match="does not fit"):
        _routed_experts(Delta(np.full((1, 1, 1), 255, dtype=np.uint8)))  # 255 is NO_EXPERT
    assert _routed_experts(Delta(None)) is None
    assert torch.equal(_routed_experts(Delta(np.array([[[-1, 3]]]))), torch.tensor([[[255, 3]]], dtype=torch.uint8))
