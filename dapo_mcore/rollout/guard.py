"""One clear message when an engine fails: an exception inside an adapter (an engine that raises, a worker
that died) becomes an EngineError naming the engine, the call and the cause, which the CLI prints as one
line and exits on (exit code 3, utils/errors.py). The original exception stays chained to it and its whole
traceback is logged once, at error level, on the rank it happened on (under Slurm: that task's log file),
where the one line is too short to debug a CUDA or NCCL failure. Under torchrun/srun the exit of that rank
ends the job: no rank waits for it in a hang."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from dapo_mcore.rollout.base import AnswerRequest, Completion, OnFinished, RolloutEngine, SamplingParams
from dapo_mcore.utils.errors import DapoError, EngineError
from dapo_mcore.utils.logging import get_logger

log = get_logger(__name__)


class GuardedEngine:
    def __init__(self, name: str, create: Callable[[], RolloutEngine]):
        self.name = name
        self.inner: RolloutEngine = self._call("start", create)

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except DapoError:
            raise  # already says what is wrong (an unknown weight name, a wrong shape)
        except Exception as err:
            log.error("rollout engine '%s' failed in %s; the engine's traceback:", self.name, what, exc_info=err)
            cause = str(err).strip().splitlines()[-1] if str(err).strip() else ""
            raise EngineError(f"rollout engine '{self.name}' failed in {what}: {type(err).__name__}: {cause}") from err

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        return self._call("generate", self.inner.generate, prompt_ids, params)

    def generate_answers(
        self, requests: list[AnswerRequest], params: SamplingParams, on_finished: OnFinished
    ) -> list[Completion]:
        return self._call("generate_answers", self.inner.generate_answers, requests, params, on_finished)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._call("update_weights", self.inner.update_weights, named_tensors)

    def release_memory(self) -> None:
        self._call("release_memory", self.inner.release_memory)

    def resume_memory(self) -> None:
        self._call("resume_memory", self.inner.resume_memory)

    def shutdown(self) -> None:
        self._call("shutdown", self.inner.shutdown)
