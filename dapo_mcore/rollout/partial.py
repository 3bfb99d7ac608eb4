"""Partial rollout: the pieces the sampler uses when `rollout.partial_rollout` is on.

A synchronous round ends only when its longest answer ends, so through the long tail of long-CoT answers most
of the engine's batch slots idle. With partial rollout (slime's --partial-rollout with over-sampling, APRIL,
arXiv 2509.18521; AReaL's interruptible generation) a round stops as soon as this replica has its share of
the step's kept groups; every unfinished answer comes back with its tokens so far and waits, with its group,
to be continued first at the next round (the next step's: by the new weights). Each answer records which
weights generated which of its tokens (Sample.version_runs); a group is scored and filtered only once all its
answers have ended. Groups begun more than `partial_max_staleness` weight versions ago are dropped.

Legend: a "pending" group has at least one unfinished answer (finish_reason "abort").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dapo_mcore.data.types import Group, Sample, token_tensor, value_tensor
from dapo_mcore.rollout.base import AnswerRequest, Completion


def _ints(values) -> list:
    return values.tolist() if hasattr(values, "tolist") else list(values)


def empty_answers(prompt_ids: list[int], n: int, step: int) -> list[Sample]:
    """A new group's n answers, none begun."""
    return [Sample(list(prompt_ids), [], [], "abort", policy_step=step) for _ in range(n)]


@dataclass(frozen=True)
class AnswerSlot:
    group: int  # position in the round's groups
    sample: int  # position in the group


def answer_requests(
    groups: list[Group], max_response_len: int, seed: int
) -> tuple[list[AnswerRequest], list[AnswerSlot]]:
    """One request per unfinished answer of `groups`: its prompt, the tokens it has so far and what is left of
    the token budget; request i's seed is seed + i."""
    requests, slots = [], []
    for gi, group in enumerate(groups):
        for si, sample in enumerate(group.samples):
            if sample.finished:
                continue
            prefix = tuple(_ints(sample.response_ids))
            request = AnswerRequest(
                _ints(sample.prompt_ids), max_response_len - len(prefix), seed + len(requests), prefix
            )
            requests.append(request)
            slots.append(AnswerSlot(gi, si))
    return requests, slots


def extend_answer(sample: Sample, completion: Completion, version: int) -> Sample:
    """`sample` with `completion`'s tokens appended, tagged with the weight version that generated them."""
    runs = [list(run) for run in sample.token_versions()]
    new = len(completion.token_ids)
    if new:
        if runs and runs[-1][0] == version:
            runs[-1][1] += new
        else:
            runs.append([version, new])
    return Sample(
        prompt_ids=sample.prompt_ids,
        response_ids=torch.cat([token_tensor(sample.response_ids), token_tensor(completion.token_ids)]),
        rollout_logprobs=torch.cat([value_tensor(sample.rollout_logprobs), value_tensor(completion.logprobs)]),
        finish_reason=completion.finish_reason,
        response_text=completion.text,
        policy_step=runs[0][0] if runs else version,
        version_runs=runs,
        # the last round's routing covers the whole answer: the engine took its earlier tokens as input; an
        # unfinished answer's is replaced when it is continued, so it is not kept meanwhile (384 B a token at
        # Qwen3-30B-A3B: most of what a pending group holds)
        routed_experts=completion.routed_experts if completion.finish_reason != "abort" else None,
        routing_dropped=completion.routing_dropped,
    )


class QuotaStopper:
    """on_finished for one replica's share of a round: as an answer ends it joins its group; a group whose
    answers have all ended is scored and filtered at once (`judge`: True when kept), and the round stops once
    `quota` groups are kept. Judged groups' verdicts and keep decisions are kept, so that they are not scored
    or filtered twice."""

    def __init__(
        self, groups: list[Group], slots: list[AnswerSlot], quota: int, judge: Callable[[Group], bool], version: int
    ):
        self.groups, self.slots, self.quota, self.judge, self.version = groups, slots, quota, judge, version
        self.waiting = [sum(not s.finished for s in g.samples) for g in groups]
        self.ended: dict[int, list[Sample]] = {}  # group -> its answers so far (the ended ones extended)
        self.judged: dict[int, Group] = {}  # group -> the scored whole group
        self.kept: set[int] = set()  # the judged groups the filter kept

    def __call__(self, index: int, completion: Completion) -> bool:
        slot = self.slots[index]
        answers = self.ended.setdefault(slot.group, list(self.groups[slot.group].samples))
        answers[slot.sample] = extend_answer(answers[slot.sample], completion, self.version)
        self.waiting[slot.group] -= 1
        if self.waiting[slot.group] == 0:
            whole = Group(self.groups[slot.group].prompt, answers)
            self.judged[slot.group] = whole
            if self.judge(whole):
                self.kept.add(slot.group)
        return len(self.kept) >= self.quota


@dataclass
class RoundStats:
    """One replica's round, for the step's metrics: requests sent (continued: with tokens already), tokens
    generated, and the longest answer's new tokens (the round's decode steps, when all fit in one batch)."""

    requests: int = 0
    continued: int = 0
    new_tokens: int = 0
    longest: int = 0

    @classmethod
    def of(cls, requests: list[AnswerRequest], completions: list[Completion]) -> RoundStats:
        lengths = [len(c.token_ids) for c in completions]
        return cls(len(requests), sum(bool(r.answer_prefix) for r in requests), sum(lengths), max(lengths, default=0))


def partial_metrics(stats: list[RoundStats], stale_answers: int, stale_tokens: int, pending: int) -> dict[str, float]:
    """The step's partial-rollout metrics over every replica's rounds. Slot utilisation: the share of
    (answer x decode step) slots that produced a token, each round taken as long as its longest answer."""
    slots = sum(s.requests * s.longest for s in stats)
    return {
        "rollout/continued_answers": float(sum(s.continued for s in stats)),
        "rollout/generated_tokens": float(sum(s.new_tokens for s in stats)),
        "rollout/slot_utilization": sum(s.new_tokens for s in stats) / slots if slots else 1.0,
        "rollout/stale_dropped_answers": float(stale_answers),
        "rollout/stale_dropped_tokens": float(stale_tokens),
        "rollout/unfinished_groups": float(pending),
    }


def split_stale(groups: list[Group], step: int, max_staleness: int) -> tuple[list[Group], list[Group]]:
    """(fresh enough, stale): a group is stale when its oldest answer was begun more than max_staleness weight
    versions before `step`."""
    fresh, stale = [], []
    for group in groups:
        begun = min(s.policy_step for s in group.samples)
        (stale if step - begun > max_staleness else fresh).append(group)
    return fresh, stale
