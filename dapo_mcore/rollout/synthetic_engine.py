"""A stand-in rollout engine for scale rehearsals and tests: answers drawn at once, without a model.

FOR REHEARSALS AND TESTS ONLY: it trains nothing useful. It lets the real training loop (sampler, dynamic
sampling, exchange, actor, weight push) run the recipes' real counts (512 prompts x 16 answers of up to 20k
tokens) on the CPU, before anyone books a cluster (docs/engines.md). What it models, per answer:

- length: lognormal, its mean before the cap growing linearly over the run's steps (SyntheticSettings); an
  answer longer than its max_new_tokens is cut there (finish reason "length", no end-of-sequence token), the
  others end with the model's first end-of-sequence id (finish reason "stop");
- tokens: uniform over the vocabulary without special, added or end-of-sequence ids;
- log-probs: one per token, float32, log p = -(exponential with mean 0.35 nats), a sampled token's typical
  surprise at temperature 1 (they are not the actor's: the mismatch guard must be off);
- routing (mixture-of-experts models, when asked for, as the hf engine returns it): [rows, layers, top-k] uint8,
  top-k distinct experts drawn per token in each sparse layer, NO_EXPERT in dense layers;
- verdict: each prompt's solve probability is drawn from a Beta with mean `solve_rate` (seeded by the prompt's
  tokens: the same prompt is as hard at every step), each answer is correct with it by a hash of (seed,
  prompt, answer), and a truncated one is wrong (truncated_wrong). The verdict ends the answer's text, where
  the reward rule algorithm.reward.verifier=synthetic reads it (rewards/synthetic_rule.py): the real reward
  path scores it.

Determinism: everything is a function of rollout.synthetic.seed and rollout.seed, the request (its prompt, seed
and answer prefix) and the engine's step, which it counts from the weight pushes it takes (the trainer pushes
once before the first step and once after each update). A resumed run's engine counts from the resume, so its
length curve starts again at mean_len_first: a rehearsal is meant to run from the start. Sampling parameters
(temperature, top-p) change nothing.

Stop and continue (partial rollout): an answer's identity is its prompt and its first HEAD_TOKENS tokens
(drawn from the request's seed); its length and verdict, and every later token and log-prob, are functions of
that identity and of the position. A round stopped part-way returns each unfinished answer with the tokens of
the decode steps so far (every answer of a round starts at step 0 and makes one token a step); a later request
with that answer as its prefix continues it, token for token, to the same drawn length (at the same step; a
continuation at a later step takes the same quantile of that step's distribution: longer by the mean's growth,
and at least one token more than it has).
So that an unfinished answer always carries its identity, a round stops no earlier than the decode step at
which every new answer has its first HEAD_TOKENS tokens.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np
import torch

from dapo_mcore.config.schema import SyntheticEngineConfig, TrainerConfig
from dapo_mcore.data.types import NO_EXPERT
from dapo_mcore.rewards.synthetic_rule import verdict_text
from dapo_mcore.rollout.base import (
    AnswerRequest,
    Completion,
    EngineSettings,
    OnFinished,
    SamplingParams,
    generate_by_answers,
    routing_rows,
    step_poll,
)
from dapo_mcore.rollout.model_info import check_weight

# An answer's identity: its prompt and its first tokens (4 tokens of a 100-id vocabulary: 1e8 identities).
HEAD_TOKENS = 4
# Mean surprise of a sampled token, in nats (the log-probs' mean is minus this).
_NLL_MEAN = 0.35
_CFG = SyntheticEngineConfig()


@dataclass(frozen=True)
class SyntheticSettings:
    """The synthetic engine's knobs (config: rollout.synthetic; schema.py says what each is)."""

    mean_len_first: float = _CFG.mean_len_first
    mean_len_last: float = _CFG.mean_len_last
    length_sigma: float = _CFG.length_sigma
    truncated_wrong: bool = _CFG.truncated_wrong
    solve_rate: float = _CFG.solve_rate
    solve_concentration: float = _CFG.solve_concentration
    seed: int = _CFG.seed
    # The run's steps (trainer.steps): the mean length reaches mean_len_last at the last one.
    steps: int = TrainerConfig().steps

    @classmethod
    def of(cls, config: SyntheticEngineConfig, steps: int) -> SyntheticSettings:
        """From the config's rollout.synthetic section and trainer.steps."""
        return cls(
            config.mean_len_first,
            config.mean_len_last,
            config.length_sigma,
            config.truncated_wrong,
            config.solve_rate,
            config.solve_concentration,
            config.seed,
            steps,
        )

    def mean_len(self, step: int) -> float:
        """The mean answer length (before the cap) at `step` (0-based updates done): linear from the first step
        (0) to the last (steps - 1), constant after."""
        done = min(max(step, 0) / max(self.steps - 1, 1), 1.0)
        return self.mean_len_first + (self.mean_len_last - self.mean_len_first) * done


@dataclass(frozen=True)
class MoERouting:
    """What a mixture-of-experts model's routing looks like: its layers, which of them are sparse, the experts
    and the top-k of each token."""

    num_layers: int
    sparse_layers: tuple[int, ...]
    num_experts: int
    topk: int


@dataclass(frozen=True)
class _Plan:
    """An answer as drawn: its identity (key), first tokens, length, verdict; and what this request returns."""

    key: int
    prompt: int  # the prompt's key
    head: tuple[int, ...]
    length: int
    correct: bool
    prefix_len: int
    n_new: int
    reason: str


class SyntheticEngine:
    # The same seeds and steps give the same answers.
    seeded_sampling = True
    name = "synthetic"

    def __init__(
        self,
        token_ids: list[int] | np.ndarray,
        eos_id: int,
        synthetic: SyntheticSettings = SyntheticSettings(),
        routing: MoERouting | None = None,
        weight_shapes: dict[str, tuple[int, ...]] | None = None,
    ):
        """token_ids: the ids an answer's tokens are drawn from; eos_id: how a finished answer ends; routing: the
        model's, when the routing is asked for; weight_shapes: the HF parameters a push must match (None: not
        checked)."""
        self.vocab = np.asarray(token_ids, dtype=np.int64)
        if self.vocab.size == 0:
            raise ValueError("synthetic engine: no token id to draw answers from")
        self.eos_id, self.settings, self.routing = int(eos_id), synthetic, routing
        self.weight_shapes = weight_shapes
        # The step whose answers it draws: the weight pushes taken so far, less the one before the first step.
        self.step = 0
        self.pushes = 0
        self._solve: dict[int, float] = {}  # prompt key -> its solve probability
        self._topk_LEk = None
        if routing is not None:
            # a token's top-k in sparse layer l: k consecutive experts of a fixed random order of layer l's,
            # from a drawn start b: _topk_LEk[l, b] (distinct, and their combinations vary with the order)
            rng = np.random.default_rng(_key(synthetic.seed, "experts"))
            order_LE = np.stack([rng.permutation(routing.num_experts) for _ in routing.sparse_layers])
            slots_Ek = (np.arange(routing.num_experts)[:, None] + np.arange(routing.topk)) % routing.num_experts
            self._topk_LEk = order_LE[:, slots_Ek].astype(np.uint8)

    @classmethod
    def create(cls, settings: EngineSettings, synthetic: SyntheticSettings | None = None) -> SyntheticEngine:
        from transformers import AutoTokenizer

        from dapo_mcore.config.model_spec import load_hf_config, read_model_spec
        from dapo_mcore.rollout.model_info import hf_weight_shapes, stop_token_ids

        path = settings.model_path
        spec = read_model_spec(load_hf_config(path))
        tokenizer = AutoTokenizer.from_pretrained(path)
        stop_ids = stop_token_ids(path, tokenizer.eos_token_id)
        if not stop_ids:
            raise ValueError(f"synthetic engine: {path} declares no end-of-sequence id")
        excluded = set(stop_ids) | set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
        token_ids = [i for i in range(min(spec.vocab_size, len(tokenizer))) if i not in excluded]
        routing = None
        if settings.return_routed_experts and spec.is_moe:
            sparse = tuple(i for i, moe in enumerate(spec.moe_layers) if moe)
            routing = MoERouting(spec.num_layers, sparse, spec.num_experts, spec.moe_topk)
        synthetic = synthetic or SyntheticSettings()
        # rollout.seed too (it also seeds each request): runs that differ in it draw other prompts' difficulties
        synthetic = replace(synthetic, seed=_key(synthetic.seed, settings.seed) >> 1)
        return cls(token_ids, stop_ids[0], synthetic, routing, hf_weight_shapes(path))

    # ---- generation ---------------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        return generate_by_answers(self, prompt_ids, params)

    def generate_answers(
        self, requests: list[AnswerRequest], params: SamplingParams, on_finished: OnFinished
    ) -> list[Completion]:
        """Every answer of the round starts at decode step 0 and makes one token a step; at each step the answers
        that end there are told to on_finished (in request order, until it says stop), then its poll() is asked.
        A stop ends the round at that step (or at the first step at which every new answer has its first
        HEAD_TOKENS tokens): each answer still unfinished comes back as "abort" with its tokens so far."""
        plans = [self._plan(r, self.step) for r in requests]
        ending: dict[int, list[int]] = {}
        for i, plan in enumerate(plans):
            ending.setdefault(plan.n_new, []).append(i)
        earliest_stop = max((HEAD_TOKENS - p.prefix_len for p in plans), default=0)
        poll = step_poll(on_finished)
        done: dict[int, Completion] = {}  # request -> its completion, once the answer ended
        for i in ending.get(0, ()):  # no budget left: ended before the first step
            done[i] = self._completion(requests[i], plans[i], 0, plans[i].reason)
        stopping, stopped_at = False, None
        for t in range(1, max((p.n_new for p in plans), default=0) + 1):
            for i in ending.get(t, ()):
                done[i] = self._completion(requests[i], plans[i], t, plans[i].reason)
                if not stopping:
                    stopping = bool(on_finished(i, done[i]))
            stopping = stopping or bool(poll())
            if stopping and t >= earliest_stop:
                stopped_at = t
                break
        return [
            done[i] if i in done else self._completion(requests[i], plans[i], stopped_at, "abort")
            for i in range(len(requests))
        ]

    def _plan(self, request: AnswerRequest, step: int) -> _Plan:
        """The answer `request` starts or continues: its identity, drawn length and verdict, and how many
        tokens this request adds to it."""
        cfg, prefix = self.settings, tuple(int(t) for t in request.answer_prefix)
        prompt = _prompt_key(request.prompt_ids)
        head = prefix[:HEAD_TOKENS]
        if len(head) < HEAD_TOKENS:  # a new answer (or one stopped before its head): the request's seed draws it
            drawn = _stream(_key(cfg.seed, "head", prompt, request.seed), len(head), HEAD_TOKENS - len(head))
            head += tuple(int(t) for t in self.vocab[drawn % np.uint64(self.vocab.size)])
        key = _key(cfg.seed, "answer", prompt, *head)
        u = _uniform(_stream(key, 0, 3))
        z = math.sqrt(-2.0 * math.log(u[0])) * math.cos(2.0 * math.pi * u[1])  # Box-Muller: a standard normal
        mu = math.log(cfg.mean_len(step)) - cfg.length_sigma**2 / 2  # the lognormal's mean is mean_len(step)
        length = max(1, math.ceil(math.exp(min(mu + cfg.length_sigma * z, 40.0))))
        left, budget = length - len(prefix), request.max_new_tokens
        if budget <= 0:
            n_new, reason = 0, "length"
        elif left > budget:
            n_new, reason = budget, "length"
        else:  # ends here (at least with its end-of-sequence token)
            n_new, reason = max(left, 1), "stop"
        correct = bool(u[2] < self._solve_probability(prompt)) and not (reason == "length" and cfg.truncated_wrong)
        return _Plan(key, prompt, head, length, correct, len(prefix), n_new, reason)

    def _solve_probability(self, prompt: int) -> float:
        """The prompt's own probability of a correct answer: Beta(c r, c (1 - r)), mean r = solve_rate."""
        if prompt not in self._solve:
            rate, c = self.settings.solve_rate, self.settings.solve_concentration
            if rate <= 0.0 or rate >= 1.0:
                p = min(max(rate, 0.0), 1.0)
            else:
                p = float(np.random.default_rng([self.settings.seed & _MASK, prompt]).beta(c * rate, c * (1 - rate)))
            if len(self._solve) > 1_000_000:  # a data set's prompts, kept; past that, begin again
                self._solve.clear()
            self._solve[prompt] = p
        return self._solve[prompt]

    def _completion(self, request: AnswerRequest, plan: _Plan, n: int, reason: str) -> Completion:
        """The request's n new tokens of the answer (positions prefix_len ...), their log-probs, its text (the
        verdict at its end once finished) and routing."""
        positions = np.arange(plan.prefix_len, plan.prefix_len + n, dtype=np.uint64)
        body = self.vocab[_mix((np.uint64(plan.key) ^ _BODY) + positions * _GAMMA) % np.uint64(self.vocab.size)]
        in_head = positions < HEAD_TOKENS
        if in_head.any():
            body[in_head] = np.asarray(plan.head, dtype=np.int64)[positions[in_head].astype(np.int64)]
        if reason == "stop" and n:
            body[-1] = self.eos_id
        logprobs = _NLL_MEAN * np.log(_uniform(_mix((np.uint64(plan.key) ^ _LOGPROB) + positions * _GAMMA)))
        total = plan.prefix_len + n
        if reason == "abort":
            text = f"(synthetic answer, unfinished at {total} tokens)"
        else:
            text = f"(synthetic answer of {total} tokens) {verdict_text(plan.correct)}"
        routed = None
        if self.routing is not None and reason != "abort" and request.keep_routing:
            routed = self._routed(request, n, plan)
        tokens = torch.from_numpy(body.astype(np.int32))
        return Completion(tokens, torch.from_numpy(logprobs.astype(np.float32)), reason, text, routed)

    def _routed(self, request: AnswerRequest, n_new: int, plan: _Plan) -> torch.Tensor | None:
        """[rows, layers, top-k] uint8 as the hf engine returns it: every input token and every new token but
        the last; top-k distinct experts per token in each sparse layer, NO_EXPERT in the dense ones. A prompt's
        tokens are routed alike in all its answers (the same prefill), the answer's by the answer."""
        routing = self.routing
        rows = routing_rows(request, n_new)
        if n_new == 0 or rows < 0:
            return None
        n_sparse, n_prompt = len(routing.sparse_layers), min(len(request.prompt_ids), rows)
        by_prompt = _key(self.settings.seed, "routing", plan.prompt)
        by_answer = _key(plan.key, "routing", request.seed)
        starts = np.concatenate(
            [_stream(by_prompt, 0, n_prompt * n_sparse), _stream(by_answer, 0, (rows - n_prompt) * n_sparse)]
        )
        start_RL = (starts % np.uint64(routing.num_experts)).astype(np.int64).reshape(rows, n_sparse)
        # built in numpy: torch's element-wise kernels on small uint8 tensors cost more in thread start-up
        routed = np.full((rows, routing.num_layers, routing.topk), NO_EXPERT, dtype=np.uint8)
        routed[:, list(routing.sparse_layers)] = self._topk_LEk[np.arange(n_sparse), start_RL]
        return torch.from_numpy(routed)

    # ---- weights and memory -------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Takes every tensor (the export gathers them as they are read) and checks its name and shape; keeps
        none. Each push is a new weight version: the next step's answers."""
        for name, tensor in named_tensors:
            if self.weight_shapes is not None:
                check_weight(self.name, self.weight_shapes, name, tuple(tensor.shape))
        self.step = self.pushes
        self.pushes += 1

    def release_memory(self) -> None:
        """Nothing to release: it holds no weights and no cache."""

    def resume_memory(self) -> None:
        """Nothing to take back."""

    def shutdown(self) -> None:
        self._solve = {}


# ---- counter-based random numbers: a value per (key, position), whatever was drawn before -------------------
_MASK = (1 << 64) - 1
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_BODY = np.uint64(0x5851F42D4C957F2D)
_LOGPROB = np.uint64(0x14057B7EF767814F)


def _key(*parts: object) -> int:
    """A 64-bit key of the parts (stable across machines and Python runs)."""
    text = "/".join(str(p) for p in parts)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _prompt_key(prompt_ids) -> int:
    ids = prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else list(prompt_ids)
    data = np.asarray(ids, dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, element-wise on uint64 (array arithmetic wraps around modulo 2^64)."""
    x = np.asarray(x, dtype=np.uint64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _stream(key: int, start: int, n: int) -> np.ndarray:
    """n uint64 values of key's stream from position `start`."""
    return _mix(np.uint64(key) + np.arange(start, start + n, dtype=np.uint64) * _GAMMA)


def _uniform(h: np.ndarray) -> np.ndarray:
    """uint64 values as float64 uniforms in (0, 1)."""
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
