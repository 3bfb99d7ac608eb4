"""One RL step's training batch: generate groups, score them, keep the informative ones, repeat.

Each generation round splits its prompts over every rank (each rank hosts an engine replica), scores its
share locally, and all-gathers the groups so every rank holds the same batch. Rounds continue until
`prompts_per_step` groups are kept or `max_rounds` is reached; surplus kept groups are carried into the
next step instead of being thrown away (REFERENCE.md section 4, complaint 2).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dapo_mcore.algo.advantages import group_advantages
from dapo_mcore.algo.dynamic_sampling import keep_group_mask
from dapo_mcore.algo.shaping import overlong_filter_mask, soft_overlong_penalty
from dapo_mcore.data.datasets import PromptStream
from dapo_mcore.data.types import Group, Prompt, Sample
from dapo_mcore.rollout.base import RolloutEngine, SamplingParams
from dapo_mcore.utils.errors import DapoError
from dapo_mcore.utils.seeding import derive_seed
from dapo_mcore.utils.timers import PhaseTimer


@dataclass(frozen=True)
class SamplerSettings:
    n_samples_per_prompt: int
    prompts_per_step: int
    gen_prompts_per_round: int
    temperature: float
    top_p: float
    max_response_len: int
    seed: int
    reward_correct: float
    reward_wrong: float
    adv_eps: float
    overlong_enabled: bool
    overlong_buffer_len: int
    overlong_penalty_factor: float
    overlong_filter: bool
    dynamic_sampling: bool
    max_rounds: int
    on_cap: str


@dataclass
class RolloutBatch:
    groups: list[Group]
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]


class DynamicSamplingCapError(DapoError):
    pass


class RolloutSampler:
    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        prompts: PromptStream,
        verifier: Callable[[str, str], bool],
        settings: SamplerSettings,
        rank: int,
        world_size: int,
        all_gather: Callable[[Any], list[Any]],
    ):
        self.engine, self.tokenizer, self.prompts, self.verifier = engine, tokenizer, prompts, verifier
        self.settings, self.rank, self.world_size, self.all_gather = settings, rank, world_size, all_gather
        self.carry: list[Group] = []

    def next_batch(self, step: int, timer: PhaseTimer, on_round: Callable[[], None] = lambda: None) -> RolloutBatch:
        cfg = self.settings
        kept, generated = list(self.carry), []
        rounds = 0
        while len(kept) < cfg.prompts_per_step and rounds < cfg.max_rounds:
            groups = self._generate_round(step, rounds, timer)
            generated += groups
            kept += [g for g, keep in zip(groups, self._keep_mask(groups)) if keep]
            rounds += 1
            on_round()
        self._handle_cap(kept, step)
        batch_groups, self.carry = kept[: cfg.prompts_per_step], kept[cfg.prompts_per_step :]
        self._assign_advantages(batch_groups)
        metrics = _rollout_metrics(generated, batch_groups, rounds, len(self.carry), cfg)
        return RolloutBatch(groups=batch_groups, metrics=metrics)

    def _generate_round(self, step: int, round_idx: int, timer: PhaseTimer) -> list[Group]:
        cfg = self.settings
        prompts = self.prompts.take(cfg.gen_prompts_per_round)  # identical on every rank
        mine = prompts[self.rank :: self.world_size]
        params = SamplingParams(
            n=cfg.n_samples_per_prompt,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_response_len,
            seed=derive_seed(cfg.seed, step, round_idx, self.rank),
        )
        with timer.phase("generate"):
            groups = self._generate(mine, params)
        with timer.phase("reward"):
            self._score(groups)
        gathered = self.all_gather(groups)
        # Undo the round-robin split so every rank sees the groups in prompt order.
        return [gathered[i % self.world_size][i // self.world_size] for i in range(len(prompts))]

    def _generate(self, prompts: list[Prompt], params: SamplingParams) -> list[Group]:
        if not prompts:
            return []
        prompt_ids = [self.tokenizer(p.text).input_ids for p in prompts]
        outputs = self.engine.generate(prompt_ids, params)
        return [
            Group(
                prompt=p,
                samples=[
                    Sample(
                        prompt_ids=ids,
                        response_ids=c.token_ids,
                        rollout_logprobs=c.logprobs,
                        finish_reason=c.finish_reason,
                        response_text=c.text,
                    )
                    for c in completions
                ],
            )
            for p, ids, completions in zip(prompts, prompt_ids, outputs)
        ]

    def _score(self, groups: list[Group]) -> None:
        cfg = self.settings
        samples = [s for g in groups for s in g.samples]
        if not samples:
            return
        for g in groups:
            for s in g.samples:
                s.correct = self.verifier(s.response_text, g.prompt.answer)
        lengths_B = torch.tensor([len(s.response_ids) for s in samples])
        penalty_B = torch.zeros(len(samples))
        if cfg.overlong_enabled:
            penalty_B = soft_overlong_penalty(
                lengths_B, cfg.max_response_len, cfg.overlong_buffer_len, cfg.overlong_penalty_factor
            )
        trainable_B = torch.ones(len(samples))
        if cfg.overlong_filter:
            trainable_B = overlong_filter_mask(torch.tensor([s.truncated for s in samples]))
        for s, penalty, trainable in zip(samples, penalty_B.tolist(), trainable_B.tolist()):
            s.length_penalty = penalty
            s.reward = (cfg.reward_correct if s.correct else cfg.reward_wrong) + penalty
            s.trainable = bool(trainable)

    def _keep_mask(self, groups: list[Group]) -> list[bool]:
        if not self.settings.dynamic_sampling or not groups:
            return [True] * len(groups)
        correct_GN = torch.tensor([[s.correct for s in g.samples] for g in groups])
        return keep_group_mask(correct_GN).tolist()

    def _handle_cap(self, kept: list[Group], step: int) -> None:
        cfg = self.settings
        if len(kept) >= cfg.prompts_per_step:
            return
        message = (
            f"step {step}: dynamic sampling kept {len(kept)} of {cfg.prompts_per_step} groups after "
            f"{cfg.max_rounds} rounds (algorithm.dynamic_sampling.max_rounds)"
        )
        if cfg.on_cap == "error" or not kept:
            raise DynamicSamplingCapError(message + ("; no group to train on" if not kept else ""))
        warnings.warn(message + "; training on the kept groups", stacklevel=2)

    def _assign_advantages(self, groups: list[Group]) -> None:
        samples = [s for g in groups for s in g.samples]
        if not samples:
            return
        rewards_B = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        group_B = torch.tensor([gi for gi, g in enumerate(groups) for _ in g.samples])
        for s, adv in zip(samples, group_advantages(rewards_B, group_B, self.settings.adv_eps).tolist()):
            s.advantage = adv

    def state_dict(self) -> dict[str, Any]:
        return {"prompts": self.prompts.state_dict(), "carry": self.carry}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.carry = list(state["carry"])


def _rollout_metrics(
    generated: list[Group], batch: list[Group], rounds: int, carried: int, cfg: SamplerSettings
) -> dict[str, float]:
    metrics = {
        "dynamic_sampling/kept_groups": float(len(batch)),
        "dynamic_sampling/rounds": float(rounds),
        "dynamic_sampling/carried_groups": float(carried),
    }
    samples = [s for g in generated for s in g.samples]
    if not samples:  # the step trained on groups carried over from the previous one
        return metrics
    n = len(samples)
    accuracies = [g.accuracy for g in generated]
    metrics.update(
        {
            "rollout/accuracy": sum(s.correct for s in samples) / n,
            "rollout/reward_mean": sum(s.reward for s in samples) / n,
            "rollout/response_len_mean": sum(len(s.response_ids) for s in samples) / n,
            "rollout/truncated_frac": sum(s.truncated for s in samples) / n,
            "rollout/length_penalty_mean": sum(s.length_penalty for s in samples) / n,
            "rollout/generated_samples": float(n),
        }
    )
    if cfg.dynamic_sampling:
        metrics["dynamic_sampling/dropped_all_correct"] = float(sum(a == 1.0 for a in accuracies))
        metrics["dynamic_sampling/dropped_all_wrong"] = float(sum(a == 0.0 for a in accuracies))
    return metrics
