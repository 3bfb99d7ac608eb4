"""The groups a save holds (carried over to the next step, or partial rollout's unfinished ones), checked as the
run wrote them before a resumed run trusts them."""

from __future__ import annotations

import torch

from dapo_mcore.data.types import Group, Sample, group_from_dict
from dapo_mcore.utils.errors import CheckpointError


def saved_groups(
    saved: list[dict], kind: str, step: int | None, file: str = "", vocab_size: int | None = None
) -> list[Group]:
    """Groups of a save (carried over, or unfinished answers of partial rollout) as the run wrote them: token ids
    non-negative integers, one finite non-positive log-prob each, weight versions no newer than the save's step
    and covering the answer. A hand-edited or damaged buffer is one CheckpointError naming the group and what is
    wrong (an id out of range reached the engine and was reported as its failure, a wrong type was a TypeError,
    a version from the future a negative lag). `file`: the save's file that held them, named in the errors;
    `vocab_size`: the model's, which every token id must be below (None: not checked)."""
    if not isinstance(saved, list):
        raise CheckpointError(f"the save's {kind} groups{f' in {file}' if file else ''} are not the list the run wrote")
    groups = []
    for g, state in enumerate(saved):
        where = f"the save's {kind} group {g}" + (f" in {file}" if file else "")
        try:
            group = group_from_dict(state)
        except (TypeError, ValueError, KeyError, RuntimeError) as err:
            raise CheckpointError(f"{where} is not what the run wrote: {type(err).__name__}: {err}") from None
        for a, sample in enumerate(group.samples):
            problem = _saved_sample_problem(sample, step, vocab_size)
            if problem:
                raise CheckpointError(f"{where} (prompt {group.prompt.uid}), answer {a}: {problem}")
        groups.append(group)
    return groups


def _saved_sample_problem(sample: Sample, step: int | None, vocab_size: int | None) -> str | None:
    ids, logprobs = sample.response_ids, sample.rollout_logprobs
    for tokens in (sample.prompt_ids, ids):
        tokens = torch.as_tensor(tokens)
        if len(tokens) and int(tokens.min()) < 0:
            return f"token id {int(tokens.min())} (ids are >= 0)"
        if len(tokens) and vocab_size is not None and int(tokens.max()) >= vocab_size:
            return f"token id {int(tokens.max())}, past the model's vocabulary of {vocab_size} ids"
    if len(logprobs) != len(ids):
        return f"{len(ids)} tokens and {len(logprobs)} log-probs"
    if len(logprobs) and not (torch.isfinite(logprobs).all() and float(logprobs.max()) <= 0.0):
        return "a log-prob that is not finite or is above 0"
    versions = sample.token_versions()
    if sum(n for _, n in versions) != len(ids):
        return f"its weight versions cover {sum(n for _, n in versions)} of its {len(ids)} tokens"
    if step is not None and max((v for v, _ in versions), default=sample.policy_step) > step:
        return f"weight version {max(v for v, _ in versions)}, newer than the save's step {step}"
    return None
