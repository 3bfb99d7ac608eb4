"""Scoring a round's groups: the verifier's verdicts, rewards with the length shaping (soft overlong punishment,
paper eq. 13; a linear length penalty) and overlong filtering, the dynamic-sampling filter's keep decision
(paper eq. 11, or the config's own filter), and the group advantages of the step's batch. The sampler's round
algorithms (synchronous, partial) generate; this decides what their groups are worth, the same for both."""

from __future__ import annotations

from collections.abc import Callable

import torch

from dapo_mcore.algo.advantages import group_advantages
from dapo_mcore.algo.shaping import linear_length_penalty, overlong_filter_mask, soft_overlong_penalty
from dapo_mcore.data.types import Group
from dapo_mcore.rewards.pool import Check, Verdict
from dapo_mcore.rollout.settings import SamplerSettings
from dapo_mcore.rollout.user_functions import VerdictCheck, kept_by, verified

# What a sample holds of its verdict (copied from an earlier judgement of the same answers: score_partial).
VERDICT_FIELDS = ("correct", "timed_out", "verify_error", "verifier_reward", "reward_parts")


class GroupScoring:
    """The sampler's scoring: its settings (rewards, shaping, advantages, the filter on or off), its verify (the
    pool's, or its replica leader's verdicts) and its keep filter."""

    def __init__(
        self,
        settings: SamplerSettings,
        verify: Callable[[list[Check]], list[Verdict]],
        keep_filter: Callable[[Group], bool],
    ):
        self.settings, self.verify, self.keep_filter = settings, verify, keep_filter
        self.check_verdicts = VerdictCheck(verify)

    def judge(self, group: Group) -> bool:
        """Score a group whose answers have all ended and say whether the filter keeps it (QuotaStopper)."""
        self.score([group])
        return self.keep_mask([group])[0]

    def score_partial(self, groups: list[Group], judged: list[Group | None]) -> None:
        """Score whole groups; those judged while the round ran take the verdicts they got then."""
        for group, earlier in zip(groups, judged):
            if earlier is not None:
                for sample, scored in zip(group.samples, earlier.samples):
                    for name in VERDICT_FIELDS:
                        setattr(sample, name, getattr(scored, name))
        self.score([g for g, earlier in zip(groups, judged) if earlier is None])
        self.apply_rewards([g for g, earlier in zip(groups, judged) if earlier is not None])

    def score(self, groups: list[Group]) -> None:
        samples = [s for g in groups for s in g.samples]
        if not samples:
            return
        # a verify that raises is named as such, not as the engine it raised inside (partial rollout)
        checks = [(s.response_text, g.prompt.answer, g.prompt.row()) for g in groups for s in g.samples]
        verdicts = verified(self.verify, checks)
        answers = [s.response_text for s in samples]
        self.check_verdicts(verdicts, f"checking the {len(samples)} answers of {len(groups)} prompts", answers)
        cfg = self.settings
        for s, verdict in zip(samples, verdicts):
            s.correct, s.timed_out, s.verify_error = verdict.correct, verdict.timed_out, verdict.error is not None
            # a graded verifier's score is the reward; a verdict's is reward.correct / reward.wrong
            s.verifier_reward = verdict.score if verdict.score is not None else (
                cfg.reward_correct if verdict.correct else cfg.reward_wrong)  # fmt: skip
            s.reward_parts = dict(verdict.parts)
        self.apply_rewards(groups)

    def apply_rewards(self, groups: list[Group]) -> None:
        """Length penalties, rewards and overlong filtering, from the verdicts already on the samples."""
        samples = [s for g in groups for s in g.samples]
        if not samples:
            return
        penalty_B = self.length_penalty(torch.tensor([len(s.response_ids) for s in samples]))
        trainable_B = torch.ones(len(samples))
        if self.settings.overlong_filter:
            trainable_B = overlong_filter_mask(torch.tensor([s.truncated for s in samples]))
        for s, penalty, trainable in zip(samples, penalty_B.tolist(), trainable_B.tolist()):
            s.length_penalty = penalty
            s.reward = s.verifier_reward + penalty
            s.trainable = bool(trainable)

    def length_penalty(self, lengths_B: torch.Tensor) -> torch.Tensor:
        cfg = self.settings
        penalty_B = torch.zeros(lengths_B.shape)
        if cfg.overlong_enabled:
            penalty_B += soft_overlong_penalty(
                lengths_B, cfg.max_response_len, cfg.overlong_buffer_len, cfg.overlong_penalty_factor
            )
        if cfg.length_penalty:
            penalty_B += linear_length_penalty(
                lengths_B, cfg.length_penalty_safe_len, cfg.length_penalty_max_len, cfg.length_penalty_coef
            )
        return penalty_B

    def keep_mask(self, groups: list[Group]) -> list[bool]:
        if not self.settings.dynamic_sampling:
            return [True] * len(groups)
        return [kept_by(self.keep_filter, g) for g in groups]

    def assign_advantages(self, groups: list[Group]) -> None:
        samples = [s for g in groups for s in g.samples]
        if not samples:
            return
        cfg = self.settings
        rewards_B = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        group_B = torch.tensor([gi for gi, g in enumerate(groups) for _ in g.samples])
        advantages_B = group_advantages(rewards_B, group_B, cfg.adv_eps, cfg.adv_estimator, cfg.adv_batch_normalize)
        for s, adv in zip(samples, advantages_B.tolist()):
            s.advantage = adv
