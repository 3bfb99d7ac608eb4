"""What flows through one RL step: prompts, sampled responses (samples) and their groups.

Plain lists and floats, so they cross process boundaries (gather_object) and checkpoints unchanged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class Prompt:
    text: str
    answer: str
    # Stable identity of the prompt in its source (dataset index or generator index).
    uid: str = ""


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    # The engine's log-probability of each response token under its sampling distribution.
    rollout_logprobs: list[float]
    # "stop" (end-of-sequence or a stop string) or "length" (cut at max_response_len).
    finish_reason: str
    response_text: str = ""
    # The RL step whose weights generated the sample (carried-over groups are older than the current step).
    policy_step: int = 0
    # Set by scoring: the verifier's verdict (a check past its timeout counts as wrong), the length penalty
    # and the total reward R_i.
    correct: bool = False
    timed_out: bool = False
    length_penalty: float = 0.0
    reward: float = 0.0
    # Set from the group: A_i, and whether the sample's tokens enter the loss (overlong filtering).
    advantage: float = 0.0
    trainable: bool = True
    # Set by the actor before the update: log-probs of the response under the policy that sampled it.
    old_logprobs: list[float] | None = None
    # Set by the reference model when the KL penalty is on.
    ref_logprobs: list[float] | None = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass
class Group:
    prompt: Prompt
    samples: list[Sample] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return sum(s.correct for s in self.samples) / max(len(self.samples), 1)


def group_to_dict(group: Group) -> dict:
    """Plain dicts and lists (what checkpoints store: torch.load reads them without unpickling classes)."""
    return asdict(group)


def group_from_dict(state: dict) -> Group:
    return Group(Prompt(**state["prompt"]), [Sample(**s) for s in state["samples"]])
