"""What crosses ranks in a generation round, and how.

Each engine replica generates, scores and filters its own share of a round's prompts. Every rank then needs
to agree on which groups the step trains on and with which advantages, which takes only a summary of each
group: its prompt, its verdicts, rewards and response lengths, and the replica's keep decision (a custom
filter sees the whole group where it was generated). Those summaries are all-gathered as objects: a few
numbers per sample, no tokens.

Tokens move once, for the kept groups only (at the paper's 3 x 512 prompts a round, most generated groups
are never trained on), as flat tensors: each replica lays out its kept groups' token ids (each prompt once,
then its responses) and then their log-probs, bit-cast to int32, in one int32 tensor. The summaries give
every rank each replica's exact layout and size, so one all-gather of padded tensors moves them with no
size exchange and no pickling; the samples built from them hold tensor views, not per-token Python lists.
A mixture-of-experts engine's routing (int16 [rows, layers, k] per sample) follows, two to an int32 word.

Legend: T tokens (prompt + responses), R response tokens, G groups.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dapo_mcore.data.types import Group, Prompt, Sample, accuracy


@dataclass(frozen=True)
class SampleSummary:
    response_len: int
    finish_reason: str
    correct: bool
    timed_out: bool
    length_penalty: float
    reward: float
    trainable: bool
    policy_step: int
    version_runs: tuple[tuple[int, int], ...] = ()
    # Only for the finished answers of an unfinished group (partial rollout), scored once the group is whole.
    text: str = ""
    # The shape of the sample's routed experts (rows, layers, k); () when the engine returned none.
    routing_shape: tuple[int, ...] = ()

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass(frozen=True)
class GroupSummary:
    prompt: Prompt
    prompt_len: int
    samples: tuple[SampleSummary, ...]
    keep: bool
    owner: int  # the engine replica that holds the group's tokens
    key: tuple[int, int]  # (round, position in the owner's share of that round): finds the group there

    @property
    def accuracy(self) -> float:
        return accuracy(self.samples)

    @property
    def finished(self) -> bool:
        """Every answer ended (partial rollout leaves some unfinished when it stops a round)."""
        return all(s.finish_reason != "abort" for s in self.samples)

    @property
    def payload_len(self) -> int:
        """int32 words the group takes in its owner's tensor: tokens (prompt once), response log-probs, then
        the routing (int16, padded to whole words)."""
        return self.prompt_len + 2 * sum(s.response_len for s in self.samples) + self.routing_words

    @property
    def routing_words(self) -> int:
        return -(-sum(math.prod(s.routing_shape) for s in self.samples if s.routing_shape) // 2)


def summarize(group: Group, keep: bool, owner: int, key: tuple[int, int]) -> GroupSummary:
    whole = all(s.finished for s in group.samples)
    samples = tuple(
        SampleSummary(
            response_len=len(s.response_ids),
            finish_reason=s.finish_reason,
            correct=s.correct,
            timed_out=s.timed_out,
            length_penalty=s.length_penalty,
            reward=s.reward,
            trainable=s.trainable,
            policy_step=s.policy_step,
            version_runs=tuple((v, n) for v, n in s.version_runs),
            text="" if whole or not s.finished else s.response_text,
            routing_shape=tuple(s.routed_experts.shape) if s.routed_experts is not None else (),
        )
        for s in group.samples
    )
    prompt_len = len(group.samples[0].prompt_ids) if group.samples else 0
    return GroupSummary(group.prompt, prompt_len, samples, bool(keep), owner, key)


def pack_groups(groups: Sequence[Group]) -> torch.Tensor:
    """One int32 tensor: every group's prompt and response token ids, then every response's log-probs (float32
    bits), then every group's routing (int16 pairs), in the order of `groups`."""
    token_parts, logprob_parts, routing_parts = [], [], []
    for group in groups:
        token_parts.append(torch.as_tensor(group.samples[0].prompt_ids, dtype=torch.int32))
        for s in group.samples:
            token_parts.append(torch.as_tensor(s.response_ids, dtype=torch.int32))
            logprob_parts.append(torch.as_tensor(s.rollout_logprobs[: len(s.response_ids)], dtype=torch.float32))
        routing_parts.append(_group_routing(group))
    tokens_T = torch.cat(token_parts) if token_parts else torch.zeros(0, dtype=torch.int32)
    logprobs_R = torch.cat(logprob_parts) if logprob_parts else torch.zeros(0, dtype=torch.float32)
    routing_W = torch.cat(routing_parts) if routing_parts else torch.zeros(0, dtype=torch.int32)
    return torch.cat([tokens_T, logprobs_R.view(torch.int32), routing_W])


def _group_routing(group: Group) -> torch.Tensor:
    """The group's routed experts, flat int16 padded to an even count, as int32 words."""
    flat = [s.routed_experts.reshape(-1).to(torch.int16) for s in group.samples if s.routed_experts is not None]
    if not flat:
        return torch.zeros(0, dtype=torch.int32)
    values = torch.cat(flat)
    return torch.cat([values, values.new_zeros(values.numel() % 2)]).view(torch.int32)


def unpack_groups(summaries: Sequence[GroupSummary], payload: torch.Tensor) -> list[Group]:
    """The groups `pack_groups` laid out, rebuilt from their summaries; samples hold views of `payload`."""
    n_tokens = sum(g.prompt_len + sum(s.response_len for s in g.samples) for g in summaries)
    n_responses = sum(s.response_len for g in summaries for s in g.samples)
    tokens_T, logprobs_R = payload[:n_tokens], payload[n_tokens : n_tokens + n_responses].view(torch.float32)
    routing_W = payload[n_tokens + n_responses :]
    groups, t, r, w = [], 0, 0, 0
    for g in summaries:
        prompt_ids = tokens_T[t : t + g.prompt_len]
        t += g.prompt_len
        samples = []
        for s in g.samples:
            samples.append(_sample(s, prompt_ids, tokens_T[t : t + s.response_len], logprobs_R[r : r + s.response_len]))
            t, r = t + s.response_len, r + s.response_len
        _unpack_routing(g, samples, routing_W[w : w + g.routing_words])
        w += g.routing_words
        groups.append(Group(prompt=g.prompt, samples=samples))
    return groups


def _unpack_routing(g: GroupSummary, samples: list[Sample], words: torch.Tensor) -> None:
    values, v = words.view(torch.int16), 0
    for summary, sample in zip(g.samples, samples):
        if summary.routing_shape:
            n = math.prod(summary.routing_shape)
            sample.routed_experts = values[v : v + n].view(summary.routing_shape)
            v += n


def _sample(s: SampleSummary, prompt_ids: torch.Tensor, response_ids: torch.Tensor, logprobs: torch.Tensor) -> Sample:
    return Sample(
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        rollout_logprobs=logprobs,
        finish_reason=s.finish_reason,
        response_text=s.text,
        policy_step=s.policy_step,
        version_runs=[[v, n] for v, n in s.version_runs],
        correct=s.correct,
        timed_out=s.timed_out,
        length_penalty=s.length_penalty,
        reward=s.reward,
        trainable=s.trainable,
    )


def fetch_groups(
    wanted: Sequence[GroupSummary],
    local: dict[tuple[int, int], Group],
    replica: int,
    n_replicas: int,
    engine_tp_size: int,
    all_gather_padded: Callable[[torch.Tensor, int], list[torch.Tensor]],
) -> list[Group]:
    """The full groups of `wanted` (the same summaries, in the same order, on every rank), each taken from the
    replica that generated it: `local` holds this replica's groups by key. Collective."""
    if not wanted:  # the same on every rank: no collective
        return []
    per_owner = [[g for g in wanted if g.owner == o] for o in range(n_replicas)]
    lengths = [sum(g.payload_len for g in mine) for mine in per_owner]
    payload = pack_groups([local[g.key] for g in per_owner[replica]])
    # the ranks of one replica hold the same groups: take each replica's first rank's tensor
    gathered = all_gather_padded(payload, max(lengths))[::engine_tp_size]
    by_owner = [
        iter(unpack_groups(mine, tensor[:length])) for mine, tensor, length in zip(per_owner, gathered, lengths)
    ]
    return [next(by_owner[g.owner]) for g in wanted]
