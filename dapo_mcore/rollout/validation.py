"""k answers per problem from an engine, checked by the verifier: the core of `dapo-mcore eval` and of the
validation the trainer runs every `trainer.eval_interval` steps on held-out files.

In training, each engine replica answers its share of a file's problems (round-robin, as the sampler splits
prompts) and the verdicts are all-gathered, so every rank returns the same metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from dapo_mcore.algo.eval_metrics import eval_metrics
from dapo_mcore.config.schema import RolloutConfig, TrainerConfig
from dapo_mcore.data.types import Prompt
from dapo_mcore.rewards.pool import Check
from dapo_mcore.rollout.base import Completion, RolloutEngine, SamplingParams
from dapo_mcore.rollout.placement import ReplicaSplit
from dapo_mcore.rollout.user_functions import VerdictCheck

# correct[i][j], answers[i][j]: answer j to problem i is right / its normalised final answer
Checked = tuple[list[list[bool]], list[list[str | None]]]
# A rule the held-out answers are also checked by (trainer.eval_also_verifiers): its verdict and its extraction
Rule = tuple[Callable[[str, str], bool], Callable[[str], str | None]]


_TRAINER, _ROLLOUT = TrainerConfig(), RolloutConfig()


@dataclass(frozen=True)
class EvalSettings:
    # The config schema's defaults (one set: tests/unit/test_settings_defaults.py), the DAPO paper's AIME
    # evaluation: avg@32 at temperature 1.0, top-p 0.7.
    k: int = _TRAINER.eval_k
    temperature: float = _TRAINER.eval_temperature
    top_p: float = _TRAINER.eval_top_p
    max_new_tokens: int = _TRAINER.eval_max_response_len or _ROLLOUT.sampling.max_response_len
    seed: int = _ROLLOUT.seed
    # Prompts per engine call (of one replica).
    prompts_per_call: int = _ROLLOUT.gen_prompts_per_round


@dataclass(frozen=True)
class AnsweredProblem:
    """One problem's k answers as answer_and_check checked them (what `eval --save-answers` writes)."""

    index: int  # the problem's position in the prompts answered (in `eval`: its row in the file)
    prompt: Prompt
    completions: list[Completion]
    verdicts: list[Any]  # rewards.pool.Verdict
    extracted: list[str | None]

    def rows(self, prompt_text: str) -> list[dict[str, Any]]:
        """One JSON-ready dict per answer; prompt_text: the prompt as the model saw it (template applied)."""
        return [
            {
                "index": self.index,
                "prompt_uid": self.prompt.uid,
                "sample": j,
                "prompt": prompt_text,
                "answer": completion.text,
                "ground_truth": self.prompt.answer,
                "data_source": self.prompt.data_source,
                "extracted": extracted,
                "correct": bool(verdict.correct),
                "timed_out": bool(verdict.timed_out),
                "response_len": len(completion.token_ids),
                "finish_reason": completion.finish_reason,
            }
            for j, (completion, verdict, extracted) in enumerate(zip(self.completions, self.verdicts, self.extracted))
        ]


def answer_and_check(
    engine: RolloutEngine,
    encode: Callable[[str], Any],
    prompts: list[Prompt],
    verify: Callable[[list[Check]], list[Any]],
    extract: Callable[[str], str | None],
    settings: EvalSettings,
    on_progress: Callable[[int], None] = lambda n: None,
    on_answered: Callable[[AnsweredProblem], None] | None = None,
) -> Checked:
    """settings.k answers to each prompt; the seed of prompt i's answers depends on i only, so a problem gets
    the same answers whichever call (or replica) it is sent in. on_answered: called with each problem's
    answers, in order, as they are checked."""
    correct: list[list[bool]] = []
    answers: list[list[str | None]] = []
    check_verdicts = VerdictCheck(verify)
    for start in range(0, len(prompts), settings.prompts_per_call):
        chunk = prompts[start : start + settings.prompts_per_call]
        params = SamplingParams(
            n=settings.k,
            temperature=settings.temperature,
            top_p=settings.top_p,
            max_new_tokens=settings.max_new_tokens,
            seed=settings.seed + start * settings.k,
        )
        groups = engine.generate([encode(p.text).input_ids for p in chunk], params)
        verdicts = verify([(c.text, p.answer, p.row()) for p, group in zip(chunk, groups) for c in group])
        check_verdicts(verdicts, f"on the held-out answers of problems {start}-{start + len(chunk) - 1}")
        for i, group in enumerate(groups):
            group_verdicts = verdicts[i * settings.k : (i + 1) * settings.k]
            correct.append([v.correct for v in group_verdicts])
            answers.append([extract(c.text) for c in group])
            if on_answered is not None:
                on_answered(AnsweredProblem(start + i, chunk[i], list(group), group_verdicts, answers[-1]))
        on_progress(len(chunk))
    return correct, answers


class Validator:
    """Held-out files evaluated during training; `run()` returns eval/<file>/<metric> (same on every rank)."""

    def __init__(
        self,
        files: dict[str, list[Prompt]],
        engine: RolloutEngine,
        encode: Callable[[str], Any],
        verify: Callable[[list[Check]], list[Any]],
        extract: Callable[[str], str | None],
        settings: EvalSettings,
        replica: int = 0,
        n_replicas: int = 1,
        all_gather: Callable[[Any], list[Any]] = lambda obj: [obj],
        engine_tp_size: int = 1,
        also: dict[str, Rule] | None = None,
    ):
        self.files, self.engine, self.encode, self.verify, self.extract = files, engine, encode, verify, extract
        self.also = also or {}  # name -> rule: the same answers checked again, eval/<file>:<name>/<metric>
        self.settings, self.replica, self.n_replicas = settings, replica, n_replicas
        self.all_gather, self.engine_tp_size = all_gather, engine_tp_size
        # the replica's first rank stands for it: the arithmetic is the replica's (rollout/placement.py)
        self.split = ReplicaSplit(replica * engine_tp_size, n_replicas * engine_tp_size, engine_tp_size)

    def run(self) -> dict[str, float]:
        metrics = {}
        for name, prompts in self.files.items():
            for rule, checked in self._checked_in_order(prompts).items():
                label = Path(name).stem + (f":{rule}" if rule else "")
                for part, (correct, answers) in by_source(label, prompts, checked).items():
                    for key, value in eval_metrics(correct, answers, self.settings.k).items():
                        metrics[f"eval/{part}/{key}"] = value
        return metrics

    def _checked_in_order(self, prompts: list[Prompt]) -> dict[str, Checked]:
        """The verifier's Checked (under "") and each also-rule's, in the file's order, the same on every rank."""
        split = self.split
        # Seeds as `dapo-mcore eval` uses them with one replica; each replica's stream starts past the others'.
        settings = replace(self.settings, seed=self.settings.seed + self.replica * len(prompts) * self.settings.k)
        also: dict[str, Checked] = {rule: ([], []) for rule in self.also}
        checked = answer_and_check(self.engine, self.encode, split.mine(prompts), self.verify, self.extract, settings,
                                   on_answered=partial(self._check_also, also))  # fmt: skip
        per_replica = split.per_replica(self.all_gather({"": checked, **also}))
        return {
            rule: (
                split.in_order([mine[rule][0] for mine in per_replica], len(prompts)),  # the round-robin split undone
                split.in_order([mine[rule][1] for mine in per_replica], len(prompts)),
            )
            for rule in per_replica[0]
        }

    def _check_also(self, also: dict[str, Checked], problem: AnsweredProblem) -> None:
        check_also(self.also, also, problem)


def check_also(rules: dict[str, Rule], checked: dict[str, Checked], problem: AnsweredProblem) -> None:
    """Append the problem's answers, judged by each rule, to checked[rule] (an on_answered of answer_and_check)."""
    texts = [completion.text for completion in problem.completions]
    for rule, (is_correct, extract) in rules.items():
        checked[rule][0].append([bool(is_correct(text, problem.prompt.answer)) for text in texts])
        checked[rule][1].append([extract(text) for text in texts])


def by_source(label: str, prompts: list[Prompt], checked: Checked) -> dict[str, Checked]:
    """{label: checked} and, for a file whose rows name their data_source, {label[source]: that source's
    problems} beside it: the accuracy of each source of a mixed file."""
    out = {label: checked}
    if not any(p.data_source for p in prompts):
        return out
    correct, answers = checked
    for source in sorted({p.source_label for p in prompts}):
        rows = [i for i, p in enumerate(prompts) if p.source_label == source]
        out[f"{label}[{source}]"] = ([correct[i] for i in rows], [answers[i] for i in rows])
    return out
