"""The one boundary every engine's calls cross: its outputs checked and converted, and one clear message when it
fails.

What an engine returns becomes what the trainer holds: int32 token ids and float32 log-probs as tensors (a
Python list costs about 36 bytes a token, 8 here), checked to be as long as each other, and uint8 routing
whose rows match the tokens (a mismatch drops that sample's routing, logged once, counted by the sampler).

Failures: an exception inside an adapter (an engine that raises, a worker
that died) becomes an EngineError naming the engine, the call and the cause, which the CLI prints as one
line and exits on (exit code 3, utils/errors.py). The original exception stays chained to it and its whole
traceback is logged once, at error level, on the rank it happened on (under Slurm: that task's log file),
where the one line is too short to debug a CUDA or NCCL failure. Under torchrun/srun the exit of that rank
ends the job: no rank waits for it in a hang. A DapoError passes untouched: it already says what is wrong, and
the engine is not at fault when it is a UserCodeError from the sampler's on_finished (a verifier or filter of
the config's that raised while the engine stepped: rollout/user_functions.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch

from dapo_mcore.data.types import routing_tensor, token_tensor, value_tensor
from dapo_mcore.rollout.base import AnswerRequest, Completion, OnFinished, RolloutEngine, SamplingParams
from dapo_mcore.utils.errors import DapoError, EngineError
from dapo_mcore.utils.logging import get_logger

log = get_logger(__name__)


class GuardedEngine:
    def __init__(self, name: str, create: Callable[[], RolloutEngine]):
        self.name = name
        self._warned_routing = False
        self.inner: RolloutEngine = self._call("start", create)

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except DapoError:
            raise  # already says what is wrong (an unknown weight name, a wrong shape, the user's filter)
        except Exception as err:
            log.error("rollout engine '%s' failed in %s; the engine's traceback:", self.name, what, exc_info=err)
            cause = str(err).strip().splitlines()[-1] if str(err).strip() else ""
            raise EngineError(f"rollout engine '{self.name}' failed in {what}: {type(err).__name__}: {cause}") from err

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        groups = self._call("generate", self.inner.generate, prompt_ids, params)
        self._require(len(groups) == len(prompt_ids), f"{len(groups)} answer lists for {len(prompt_ids)} prompts")
        out = []
        keep = params.keep_routing or (True,) * len(prompt_ids)
        for i, (ids, completions) in enumerate(zip(prompt_ids, groups)):
            self._require(len(completions) == params.n, f"{len(completions)} answers for prompt {i}, not {params.n}")
            checked = [self._checked(c, len(ids), f"answer {j} of prompt {i}") for j, c in enumerate(completions)]
            if not keep[i]:  # an adapter that returned it anyway: another rank keeps it
                checked = [dataclasses.replace(c, routed_experts=None) for c in checked]
            out.append(checked)
        return out

    def generate_answers(
        self, requests: list[AnswerRequest], params: SamplingParams, on_finished: OnFinished
    ) -> list[Completion]:
        completions = self._call("generate_answers", self.inner.generate_answers, requests, params, on_finished)
        self._require(len(completions) == len(requests), f"{len(completions)} answers for {len(requests)} requests")
        return [
            self._checked(c, len(r.prompt_ids) + len(r.answer_prefix), f"answer {i}")
            for i, (r, c) in enumerate(zip(requests, completions))
        ]

    def _require(self, ok: bool, what: str) -> None:
        if not ok:
            raise EngineError(f"rollout engine '{self.name}' returned {what}")

    def _checked(self, c: Completion, n_input: int, where: str) -> Completion:
        """The completion as the trainer holds it: int32 token ids and float32 log-probs of equal length (one
        log-prob short would shift every later sample of the replica's batch), and uint8 routing whose rows
        match the tokens, or none (counted: the actor's routers then choose for this sample)."""
        tokens, logprobs = token_tensor(c.token_ids), value_tensor(c.logprobs)
        self._require(
            tokens.dim() == 1 and logprobs.shape == tokens.shape,
            f"{len(logprobs)} log-probs for {len(tokens)} tokens in {where}",
        )
        not_finite = (~torch.isfinite(logprobs)).nonzero().flatten()
        if len(not_finite):  # a NaN weight pushed into the engine shows here first, before any loss or KL
            t = int(not_finite[0])
            self._require(False, f"a log-prob that is not a finite number ({logprobs[t].item()} at token {t} of "
                          f"{len(tokens)}) in {where}: its weights or its numerics are broken (a NaN or inf weight "
                          "pushed into it?)")  # fmt: skip
        routed, dropped = self._checked_routing(c.routed_experts, n_input + len(tokens) - 1, where)
        return Completion(tokens, logprobs, c.finish_reason, c.text, routed, dropped or c.routing_dropped)

    def _checked_routing(self, routed, rows: int, where: str) -> tuple[torch.Tensor | None, bool]:
        if routed is None:
            return None, False
        problem = None
        try:
            routed = routing_tensor(routed)
        except ValueError as err:
            problem = str(err)
        if problem is None and (routed.dim() != 3 or routed.shape[0] != rows):
            problem = f"routing of shape {tuple(routed.shape)} for {rows} input positions"
        if problem is None:
            return routed, False
        if not self._warned_routing:  # once a run: the metric counts every one
            self._warned_routing = True
            log.warning("rollout engine '%s': %s in %s; that sample's routing is dropped (the actor's routers "
                        "choose), counted in rollout/routing_dropped", self.name, problem, where)  # fmt: skip
        return None, True

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._call("update_weights", self.inner.update_weights, named_tensors)

    def release_memory(self) -> None:
        self._call("release_memory", self.inner.release_memory)

    def resume_memory(self) -> None:
        self._call("resume_memory", self.inner.resume_memory)

    def shutdown(self) -> None:
        self._call("shutdown", self.inner.shutdown)
