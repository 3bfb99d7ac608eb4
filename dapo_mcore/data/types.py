"""What flows through one RL step: prompts, sampled responses (samples) and their groups.

A sample's token ids and log-probs are 1-D int32 / float32 tensors from the engine adapter on (rollout/guard.py
converts what an engine returns), views of one flat tensor once the step's batch has moved between ranks
(rollout/exchange.py), and NotHere (their count only) on a rank that does not train the sample; code that
builds samples by hand may pass lists, and whatever reads them takes either. Checkpoints store them as tensors
(group_to_dict).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields

import torch

TokenIds = Sequence[int] | torch.Tensor  # list[int] or a 1-D integer tensor
Values = Sequence[float] | torch.Tensor  # list[float] or a 1-D float tensor

# Routed experts (Sample.routed_experts) are uint8 expert ids, NO_EXPERT where the router chose none (a dense
# layer, padding, an unknown row): 48 layers x top-8 = 384 bytes a token at 30B-A3B, half of int16's. Models
# with more than 255 experts cannot replay their routing (build.py check_routing_replay refuses them).
ROUTING_DTYPE = torch.uint8
NO_EXPERT = 255


def token_tensor(ids: TokenIds) -> torch.Tensor:
    """Token ids as the 1-D int32 tensor samples hold (8 bytes a token less than a list's 36)."""
    return torch.as_tensor(ids, dtype=torch.int32)


def value_tensor(values: Values) -> torch.Tensor:
    """Per-token values (log-probs) as the 1-D float32 tensor samples hold."""
    return torch.as_tensor(values, dtype=torch.float32)


def routing_tensor(experts) -> torch.Tensor:
    """An engine's routed experts [rows, layers, k] (any integer type; a negative id means none) as uint8,
    NO_EXPERT where none. Ids past 254 cannot be held: a ValueError."""
    t = torch.as_tensor(experts)
    if t.dtype == ROUTING_DTYPE:
        return t
    t = t.to(torch.int64)
    if t.numel() and int(t.max()) >= NO_EXPERT:
        raise ValueError(f"expert id {int(t.max())} does not fit the routing's uint8 (ids 0-{NO_EXPERT - 1})")
    return torch.where(t < 0, NO_EXPERT, t).to(ROUTING_DTYPE)


class NotHere(Sequence):
    """The tokens (or log-probs) of a sample that another data-parallel rank trains: only their count is known
    here (rollout/exchange.py sends each sample's tokens to the ranks that train it). Reading a value raises,
    so that nothing trains on, or saves, tokens this rank never received."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index):
        raise LookupError("this sample's tokens are held by the data-parallel ranks that train it, not this one")

    def __repr__(self) -> str:
        return f"NotHere({self.n})"


@dataclass
class Prompt:
    text: str
    answer: str
    # Stable identity of the prompt in its source (dataset index or generator index).
    uid: str = ""
    # The row's `data_source` field (verl's name): which verifier judges it (algorithm.reward.verifiers) and the
    # name its accuracy is logged under; "" for a file without one.
    data_source: str = ""
    # Every other field of the data file's row (not the prompt, the answer or data_source), as parsed: what a
    # verifier that takes the row sees (rewards/verifiers.py).
    extra: dict = field(default_factory=dict)

    def row(self) -> dict:
        """What a verifier that takes the row gets: data_source and every extra field."""
        return {"data_source": self.data_source, **self.extra}

    @property
    def source_label(self) -> str:
        """The data source as metric names hold it: one path segment ("openai/gsm8k" -> "openai_gsm8k")."""
        return self.data_source.replace("/", "_") or "unnamed"


@dataclass
class Sample:
    prompt_ids: TokenIds
    response_ids: TokenIds
    # The engine's log-probability of each response token under its sampling distribution.
    rollout_logprobs: Values
    # "stop" (end-of-sequence or a stop string) or "length" (cut at max_response_len); "abort": not finished
    # yet (partial rollout: its round was stopped; it waits to be continued).
    finish_reason: str
    response_text: str = ""
    # The RL step whose weights generated the sample's first tokens (carried-over groups are older than the
    # current step).
    policy_step: int = 0
    # Which weights generated which tokens, as runs [[version, n_tokens], ...] in token order: an answer
    # continued by later weights (partial rollout) has several. Empty: all by policy_step.
    version_runs: list[list[int]] = field(default_factory=list)
    # Set by scoring: the verifier's verdict (a check past its timeout counts as wrong), the reward the verifier
    # gave (reward.correct / reward.wrong, or its graded score), the named parts of a verifier that returns a
    # dict, the length penalty and the total reward R_i (the verifier's plus the length penalty).
    correct: bool = False
    timed_out: bool = False
    verify_error: bool = False  # the verifier raised on it (counted as wrong)
    verifier_reward: float = 0.0
    reward_parts: dict = field(default_factory=dict)
    length_penalty: float = 0.0
    reward: float = 0.0
    # Set from the group: A_i, and whether the sample's tokens enter the loss (overlong filtering).
    advantage: float = 0.0
    trainable: bool = True
    # Set by the actor before the update: log-probs of the response under the policy that sampled it.
    old_logprobs: list[float] | None = None
    # Set by the reference model when the KL penalty is on.
    ref_logprobs: list[float] | None = None
    # Mixture-of-experts models, when the engine returns its routing (model.routing_replay=rollout): [tokens -
    # 1, layers, top-k] uint8, the experts its router chose at each token (prompt, then response but its last
    # token); NO_EXPERT where none (rollout/base.py Completion.routed_experts). The actor replays them.
    routed_experts: torch.Tensor | None = None
    # The engine returned routing whose rows did not match the sample's tokens: it was dropped (the actor's
    # routers choose for this sample) and counted in rollout/routing_dropped (rollout/guard.py).
    routing_dropped: bool = False

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def response_len(self) -> int:
        return len(self.response_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason != "abort"

    @property
    def held(self) -> bool:
        """This rank holds the sample's tokens (not only their count: NotHere)."""
        return not isinstance(self.response_ids, NotHere)

    def token_versions(self) -> list[tuple[int, int]]:
        """(version, n_tokens) runs covering the response, oldest first."""
        if self.version_runs:
            return [(version, n) for version, n in self.version_runs]
        return [(self.policy_step, self.response_len)] if self.response_len else []


@dataclass
class Group:
    prompt: Prompt
    samples: list[Sample] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return accuracy(self.samples)


def accuracy(samples) -> float:
    """The share of correct answers of a group (0 for none); samples: anything with `.correct`."""
    return sum(s.correct for s in samples) / max(len(samples), 1)


# The per-token fields of a sample and the tensor a save holds each as: a checkpoint holds no per-token Python
# lists (500 groups x 16 answers x 8k tokens as lists are about 5 GB of objects on every rank). Saves written
# before held lists; loading converts either.
_PER_TOKEN_FIELDS = {
    "prompt_ids": token_tensor,
    "response_ids": token_tensor,
    "rollout_logprobs": value_tensor,
    "old_logprobs": value_tensor,
    "ref_logprobs": value_tensor,
    "routed_experts": routing_tensor,
}


def group_to_dict(group: Group) -> dict:
    """Plain dicts, numbers and CPU tensors (what checkpoints store: torch.load reads them with weights_only,
    without unpickling classes)."""
    samples = [{f.name: _saved(f.name, getattr(s, f.name)) for f in fields(s)} for s in group.samples]
    return {"prompt": asdict(group.prompt), "samples": samples}


def _saved(name: str, value):
    to_tensor = _PER_TOKEN_FIELDS.get(name)
    if to_tensor is None or value is None:
        return value
    if isinstance(value, NotHere):
        raise LookupError(f"cannot save a sample's {name}: {value!r} (another data-parallel rank holds them)")
    return _own_storage(to_tensor(value).cpu())


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when it owns all of its storage, else a copy: torch.save writes a view's whole storage (a
    sample received in the step's exchange views the one flat buffer of every sample)."""
    whole = t.is_contiguous() and t.storage_offset() == 0
    if whole and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone()


def group_from_dict(state: dict) -> Group:
    """A group saved by group_to_dict, its per-token fields as tensors (from tensors or, in older saves, lists)."""
    samples = [Sample(**{k: _loaded(k, v) for k, v in s.items()}) for s in state["samples"]]
    return Group(Prompt(**state["prompt"]), samples)


def _loaded(name: str, value):
    to_tensor = _PER_TOKEN_FIELDS.get(name)
    return value if to_tensor is None or value is None else to_tensor(value)
