"""What crosses ranks in a generation round, and how.

Each engine replica generates, scores and filters its own share of a round's prompts. Every rank then needs
to agree on which groups the step trains on and with which advantages, which takes only a summary of each
group: its prompt, its verdicts, rewards and response lengths, and the replica's keep decision (a custom
filter sees the whole group where it was generated). Those summaries are all-gathered as objects: a few
numbers per sample, no tokens.

Tokens move once, for the chosen groups only, and each sample only to the ranks that train it: the data-parallel
rank the actor deals it to (data/batching.py DataParallelSplit, a function of the step's lengths, which every rank
knows from the summaries), and every rank of that DP rank's model-parallel group. Groups carried to the next step go
to every rank (each rank saves them); partial rollout's unfinished groups never move: the replica that began one
continues it (rollout/pending.py). One all-to-all over host memory (the gloo wait group) carries them: each group
is sent by one rank of its replica (its engine-TP ranks take turns by group, so each byte is sent once), each
receiver getting exactly what it takes, and the summaries give every rank every message's exact size, so there is no
size exchange, no padding and no device memory while the engine holds the GPU. A replica's engine-TP ranks all
generate the same groups; each keeps the routing (layers x top-k bytes a token, most of a group's bytes with
routing replay) of the groups it sends only (keep_routing_to_send): 1/engine-TP of the round's, not all of it.
A message holds, for its groups in order, each prompt once and the chosen responses' token ids, then their log-probs
(float32 bits), then their routing (uint8, four to a word), in one int32 tensor; the samples built from it hold
views of it. A sample another rank trains keeps its metadata and only the count of its tokens (data/types.py
NotHere).

Per rank, at the paper's step (8,192 answers, 8M-67M tokens at a 1k-8k mean): its 1/DP share of the chosen
tokens x 8 bytes (+ layers x top-k bytes with routing replay), where the all-gather it replaces received
every kept token x world size on the device. Legend: T tokens (prompts + responses), R response tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dapo_mcore.data.types import Group, NotHere, Prompt, Sample, accuracy, routing_tensor

# Trainer of a sample that every rank receives (a group carried to the next step).
EVERY_RANK = -1

# (send buffer, words to each rank, words from each rank) -> the words received, in source rank order.
Transport = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]


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
    # The shape of the sample's routed experts (rows, layers, k); () when the engine returned none.
    routing_shape: tuple[int, ...] = ()
    routing_dropped: bool = False
    verify_error: bool = False
    verifier_reward: float = 0.0
    reward_parts: dict = field(default_factory=dict)  # the verifier's named parts (reward_part/<name> metrics)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def routing_bytes(self) -> int:
        return math.prod(self.routing_shape) if self.routing_shape else 0


# The fields a summary carries as the sample holds them (the rest are converted: lengths, runs, shape):
# listed once, copied both ways by summarize and _sample.
VERBATIM_FIELDS = (
    "finish_reason", "correct", "timed_out", "verify_error", "length_penalty", "reward", "trainable", "policy_step",
    "routing_dropped", "verifier_reward", "reward_parts",
)  # fmt: skip


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


def summarize(group: Group, keep: bool, owner: int, key: tuple[int, int]) -> GroupSummary:
    samples = tuple(
        SampleSummary(
            response_len=len(s.response_ids),
            version_runs=tuple((v, n) for v, n in s.version_runs),
            routing_shape=tuple(s.routed_experts.shape) if s.routed_experts is not None else (),
            **{name: getattr(s, name) for name in VERBATIM_FIELDS},
        )
        for s in group.samples
    )
    prompt_len = len(group.samples[0].prompt_ids) if group.samples else 0
    return GroupSummary(group.prompt, prompt_len, samples, bool(keep), owner, key)


@dataclass(frozen=True)
class ExchangeRanks:
    """Who sends what to whom: engine replicas of engine_tp_size consecutive ranks (which hold the same
    groups), and the data-parallel rank of every rank (a sample goes to every rank of the DP rank that
    trains it)."""

    rank: int
    engine_tp_size: int
    dp_rank_of: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return len(self.dp_rank_of)

    def sender(self, replica: int, key: tuple[int, int]) -> int:
        """The rank of `replica` that sends the group `key` (round, position) to every receiver: the replica's
        ranks take turns by group, so each keeps the routing of its own groups only."""
        return replica * self.engine_tp_size + sum(key) % self.engine_tp_size

    def takes(self, receiver: int, trainer: int) -> bool:
        return trainer == EVERY_RANK or self.dp_rank_of[receiver] == trainer


@dataclass(frozen=True)
class _Part:
    """One group's share of one message: which of its samples the receiver takes."""

    summary: GroupSummary
    index: int  # position in `wanted`
    chosen: tuple[int, ...]  # sample positions in the group

    @property
    def token_words(self) -> int:
        return (self.summary.prompt_len if self.chosen else 0) + sum(self._lengths())

    @property
    def logprob_words(self) -> int:
        return sum(self._lengths())

    @property
    def routing_bytes(self) -> int:
        return sum(self.summary.samples[i].routing_bytes for i in self.chosen)

    def _lengths(self):
        return (self.summary.samples[i].response_len for i in self.chosen)


def _message_words(parts: Sequence[_Part]) -> int:
    routing = sum(p.routing_bytes for p in parts)
    return sum(p.token_words + p.logprob_words for p in parts) + -(-routing // 4)


def _parts(
    wanted: Sequence[GroupSummary], trainers: Sequence[Sequence[int]], ranks: ExchangeRanks, sender: int, receiver: int
) -> list[_Part]:
    """What `sender` sends `receiver`: the receiver's samples of the groups whose replica sends through
    `sender`, in wanted order (empty parts, of groups it takes nothing of, left out)."""
    parts = []
    for index, (g, group_trainers) in enumerate(zip(wanted, trainers)):
        if ranks.sender(g.owner, g.key) != sender:
            continue
        chosen = tuple(i for i, t in enumerate(group_trainers) if ranks.takes(receiver, t))
        if chosen:
            parts.append(_Part(g, index, chosen))
    return parts


def keep_routing_to_send(groups: dict[tuple[int, int], Group], replica: int, ranks: ExchangeRanks) -> None:
    """Drop the routing of the groups (this replica's, by key) that another rank of the replica sends: at the
    30B-A3B recipe's round (12,288 answers x 8k tokens x 384 B) every engine-TP rank held 39 GB of it, 310 GB a
    node. After the round's summaries are made: they describe the routing whoever sends it."""
    for key, group in groups.items():
        if ranks.sender(replica, key) != ranks.rank:
            for sample in group.samples:
                sample.routed_experts = None


def fetch_groups(
    wanted: Sequence[GroupSummary],
    trainers: Sequence[Sequence[int]],
    local: dict[tuple[int, int], Group],
    ranks: ExchangeRanks,
    transport: Transport | None,
) -> list[Group]:
    """The groups of `wanted` (the same summaries, in the same order, on every rank), each sample whole on the
    ranks that train it (trainers[g][i]: the DP rank, or EVERY_RANK) and NotHere elsewhere; `local` holds
    this replica's groups by key. Collective over every rank (one all-to-all); nothing when nothing is wanted."""
    if not wanted:  # the same on every rank: no collective
        return []
    me, world = ranks.rank, ranks.world_size
    outgoing = [_parts(wanted, trainers, ranks, me, r) for r in range(world)]
    incoming = [_parts(wanted, trainers, ranks, s, me) for s in range(world)]
    send_words, recv_words = [_message_words(p) for p in outgoing], [_message_words(p) for p in incoming]
    send = torch.cat([_pack(parts, local, words) for parts, words in zip(outgoing, send_words)])
    received = send if transport is None else transport(send, send_words, recv_words)
    if received.numel() != sum(recv_words):
        raise ValueError(f"rollout exchange: received {received.numel()} words, the summaries say {sum(recv_words)}")
    groups: list[Group | None] = [None] * len(wanted)
    for parts, message in zip(incoming, received.split(recv_words)):
        for part, group in zip(parts, _unpack(parts, message)):
            groups[part.index] = group
    return [g if g is not None else _hollow_group(summary) for g, summary in zip(groups, wanted)]


def _pack(parts: Sequence[_Part], local: dict[tuple[int, int], Group], words: int) -> torch.Tensor:
    """One message: every part's prompt (once) and chosen responses, then their log-probs (float32 bits), then
    their routing (uint8, padded to a whole int32 word). Refused unless it is the size the summaries say."""
    tokens, logprobs, routing = [], [], []
    for part in parts:
        group = local[part.summary.key]
        tokens.append(torch.as_tensor(group.samples[0].prompt_ids, dtype=torch.int32))
        for i in part.chosen:
            sample = group.samples[i]
            _check_sample(sample, part.summary.samples[i], part.summary.key)
            tokens.append(torch.as_tensor(sample.response_ids, dtype=torch.int32))
            logprobs.append(torch.as_tensor(sample.rollout_logprobs, dtype=torch.float32))
            if sample.routed_experts is not None:
                routing.append(routing_tensor(sample.routed_experts).reshape(-1))
    routing_bytes = torch.cat(routing) if routing else torch.zeros(0, dtype=torch.uint8)
    routing_bytes = torch.cat([routing_bytes, routing_bytes.new_zeros(-routing_bytes.numel() % 4)])
    message = torch.cat(
        [_cat(tokens, torch.int32), _cat(logprobs, torch.float32).view(torch.int32), routing_bytes.view(torch.int32)]
    )
    if message.numel() != words:
        raise ValueError(
            f"rollout exchange: {len(parts)} groups pack into {message.numel()} words, their summaries say {words} "
            "(a sample's log-probs or routing no longer match its tokens); not sent"
        )
    return message


def _check_sample(sample: Sample, s: SampleSummary, key: tuple[int, int]) -> None:
    """A sample sent as its summary describes it: one log-prob a token and its routing's size (a log-prob short
    would shift every later sample of the message)."""
    n, n_logprobs = len(sample.response_ids), len(sample.rollout_logprobs)
    routing = 0 if sample.routed_experts is None else sample.routed_experts.numel()
    if (n, n_logprobs, routing) != (s.response_len, s.response_len, s.routing_bytes):
        raise ValueError(
            f"rollout exchange: a sample of group {key} holds {n} tokens, {n_logprobs} log-probs and {routing} "
            f"routing values; its summary says {s.response_len}, {s.response_len} and {s.routing_bytes}: not sent"
        )


def _cat(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)


def _unpack(parts: Sequence[_Part], message: torch.Tensor) -> list[Group]:
    """The groups of one message; their chosen samples hold views of it, the others NotHere."""
    n_tokens = sum(p.token_words for p in parts)
    n_logprobs = sum(p.logprob_words for p in parts)
    tokens_T = message[:n_tokens]
    logprobs_R = message[n_tokens : n_tokens + n_logprobs].view(torch.float32)
    routing = message[n_tokens + n_logprobs :].view(torch.uint8)
    groups, t, r, b = [], 0, 0, 0
    for part in parts:
        g = part.summary
        prompt_ids = tokens_T[t : t + g.prompt_len]
        t += g.prompt_len
        samples = [_hollow_sample(s, g.prompt_len) for s in g.samples]
        for i in part.chosen:
            s = g.samples[i]
            sample = _sample(s, prompt_ids, tokens_T[t : t + s.response_len], logprobs_R[r : r + s.response_len])
            if s.routing_shape:
                sample.routed_experts = routing[b : b + s.routing_bytes].view(s.routing_shape)
                b += s.routing_bytes
            samples[i] = sample
            t, r = t + s.response_len, r + s.response_len
        groups.append(Group(prompt=g.prompt, samples=samples))
    return groups


def _hollow_group(g: GroupSummary) -> Group:
    return Group(prompt=g.prompt, samples=[_hollow_sample(s, g.prompt_len) for s in g.samples])


def _hollow_sample(s: SampleSummary, prompt_len: int) -> Sample:
    n = s.response_len
    return _sample(s, NotHere(prompt_len), NotHere(n), NotHere(n))


def _sample(s: SampleSummary, prompt_ids, response_ids, logprobs) -> Sample:
    return Sample(
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        rollout_logprobs=logprobs,
        version_runs=[[v, n] for v, n in s.version_runs],
        **{name: getattr(s, name) for name in VERBATIM_FIELDS},
    )
