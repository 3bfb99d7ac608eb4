"""`dapo-mcore eval`: avg@k, pass@k and maj@k of a model on prompt files, with any engine.

The same pieces as training (engine registry, prompt formats, verifier pool, rollout/validation.py), never a
second copy: a prompt file's problems are formatted, k answers are sampled per problem, each is checked by
the verifier, and the metrics of algo/eval_metrics.py are computed per file. The model is an HF directory,
a Megatron-Core checkpoint (tools/convert_hf_to_mcore.py output or a run save step_N/) or a run directory
(its newest intact save): checkpoints are converted to a temporary HF directory first. Results go to a JSON
file and a table; with --save-answers every answer goes to a JSONL file too.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dapo_mcore.algo.eval_metrics import eval_metrics
from dapo_mcore.data.datasets import load_jsonl_prompts
from dapo_mcore.data.templates import PromptFormatter
from dapo_mcore.rewards.answers import also_rule, answer_extractor
from dapo_mcore.rewards.by_source import VerifierChoice
from dapo_mcore.rewards.contract import ScoreRule
from dapo_mcore.rollout.base import EngineSettings
from dapo_mcore.rollout.registry import create_engine
from dapo_mcore.rollout.validation import (
    AnsweredProblem,
    Checked,
    EvalSettings,
    Rule,
    answer_and_check,
    by_source,
    check_also,
)
from dapo_mcore.utils.errors import ConfigError
from dapo_mcore.utils.logging import quiet_save_reading


def run_eval(
    model: str,
    files: list[str],
    engine_name: str,
    verifier: str | VerifierChoice,
    settings: EvalSettings,
    template: str = "none",
    instruction: str = "none",
    device: str = "cpu",
    dtype: str = "float32",
    out: str | None = None,
    save_answers: str | None = None,
    verify: bool = True,
    also: tuple[str, ...] = (),
) -> dict[str, Any]:
    """verifier: a spec, or a VerifierChoice (verifiers by data source, the correct threshold)."""
    if isinstance(verifier, str):  # eval reads any finite score (correct from the threshold): it trains nothing
        verifier = VerifierChoice(verifier, rule=ScoreRule(graded=True))
    # an HF directory is used as it is; anything else must be a checkpoint (named if it is not, before any work)
    ckpt = None if (Path(model) / "config.json").is_file() else _checkpoint_of(Path(model))
    prompt_sets = {name: load_jsonl_prompts(name) for name in files}  # every file checked before any work
    with (
        AnswerFile(save_answers) if save_answers else nullcontext() as answer_file,
        tempfile.TemporaryDirectory(prefix="dapo-eval.") as workdir,
    ):
        hf_dir = Path(model) if ckpt is None else converted_to_hf(ckpt, Path(workdir) / "hf", verify)
        engine = EngineSettings(model_path=str(hf_dir), device=device, dtype=dtype)
        prompting = (template, instruction)
        results = _evaluate(prompt_sets, engine_name, engine, verifier, settings, prompting, answer_file, also)
    results["model"] = model
    if save_answers:
        results["answers"] = save_answers
    if ckpt is not None:
        results["converted_from"] = str(ckpt)
    if out:
        Path(out).write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    return results


def converted_to_hf(ckpt: Path, out_dir: Path, verify: bool = True) -> Path:
    """A Megatron-Core checkpoint or run save written as an HF directory `out_dir` for the engine; with `verify`
    its files' CRC-32 checksums are checked first (two swapped blocks of a shard scored 0.0000 without a word)."""
    if verify:
        from dapo_mcore.checkpoint.model_checkpoint import verify_complete

        start = time.perf_counter()
        files = verify_complete(ckpt, checksums=True)
        print(f"{ckpt}: {files} files match their CRC-32 checksums ({time.perf_counter() - start:.1f} s; "
              "--no-verify skips this)", flush=True)  # fmt: skip
    print(f"converting {ckpt} to an HF directory for the engine", flush=True)
    with quiet_save_reading():
        from dapo_mcore.checkpoint.conversion import mcore_to_hf
        from dapo_mcore.parallel import destroy_parallel

        try:
            mcore_to_hf(ckpt, out_dir, dtype="")
        finally:
            destroy_parallel()  # the engine sets up its own process groups
    return out_dir


def _checkpoint_of(model: Path) -> Path:
    from dapo_mcore.checkpoint.model_checkpoint import MANIFEST
    from dapo_mcore.checkpoint.run_checkpoint import find_latest_complete

    if (model / MANIFEST).is_file():
        return model
    if (model / "checkpoints").is_dir():  # a run directory: its newest intact save
        newest = find_latest_complete(model / "checkpoints")
        if newest is None:
            raise ConfigError(f"run directory {model} holds no complete save under checkpoints/")
        return newest
    raise ConfigError(
        f"{model} is neither an HF model directory (config.json), a Megatron-Core checkpoint ({MANIFEST}) nor a "
        "run directory (checkpoints/)"
    )


def _evaluate(
    prompt_sets: dict[str, list[Any]],
    engine_name: str,
    engine_settings: EngineSettings,
    verifier: VerifierChoice,
    settings: EvalSettings,
    template_and_instruction: tuple[str, str],
    answer_file: AnswerFile | None = None,
    also: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Each file's metrics under `verifier` (results["files"][name]) and under each rule of `also`, on the same
    answers (results["files"][f"{name}:{rule}"])."""
    from transformers import AutoTokenizer

    template, instruction = template_and_instruction
    encode = PromptFormatter(AutoTokenizer.from_pretrained(engine_settings.model_path), template, instruction)
    engine = create_engine(engine_name, engine_settings)
    pool = verifier.start(workers=1)
    rules = {rule: also_rule(rule) for rule in also}
    results: dict[str, Any] = {"engine": engine_name, "verifier": pool.spec, "files": {}}
    results["settings"] = settings.__dict__ | {"template": template, "instruction": instruction}
    try:
        with _progress(sum(len(p) for p in prompt_sets.values())) as (progress, task):
            for name, prompts in prompt_sets.items():
                progress.update(task, description=Path(name).name)
                write = answer_file.writer_for(name, encode.text) if answer_file else None
                also_checked: dict[str, Checked] = {rule: ([], []) for rule in rules}
                on_answered = partial(_on_answered, write, rules, also_checked)
                correct, answers = answer_and_check(
                    engine, encode, prompts, pool.verify, answer_extractor(verifier.default), settings,
                    on_progress=lambda n: progress.advance(task, n), on_answered=on_answered,
                )  # fmt: skip
                for part, checked in by_source(name, prompts, (correct, answers)).items():
                    results["files"][part] = eval_metrics(*checked, settings.k)
                for rule, checked in also_checked.items():
                    for part, by_rule in by_source(f"{name}:{rule}", prompts, checked).items():
                        results["files"][part] = eval_metrics(*by_rule, settings.k)
    finally:
        pool.close()
        engine.shutdown()
    return results


def _on_answered(write, rules: dict[str, Rule], also_checked: dict[str, Checked], problem: AnsweredProblem) -> None:
    if write is not None:
        write(problem)
    check_also(rules, also_checked, problem)


class AnswerFile:
    """`eval --save-answers`: one JSON object per answer (the data file, the problem's row, prompt, answer,
    ground truth, extracted answer, verdict, length, finish reason), appended as each problem is checked, so
    an interrupted evaluation keeps what it answered. Opened before any work: a bad path fails at once."""

    def __init__(self, path: str):
        try:
            self.fh = Path(path).open("w")  # noqa: SIM115 (closed by __exit__: the file lives as long as the eval)
        except OSError as err:
            raise ConfigError(f"--save-answers {path}: cannot write there ({err.strerror})") from None

    def writer_for(self, data_file: str, prompt_text: Callable[[str], str]) -> Callable[[AnsweredProblem], None]:
        def write(problem: AnsweredProblem) -> None:
            rows = problem.rows(prompt_text(problem.prompt.text))
            self.fh.write("".join(json.dumps({"file": data_file, **row}) + "\n" for row in rows))
            self.fh.flush()

        return write

    def __enter__(self) -> AnswerFile:
        return self

    def __exit__(self, *exc) -> None:
        self.fh.close()


class _progress:
    def __init__(self, total: int):
        columns = (TextColumn("[bold]eval[/bold] {task.description}"), BarColumn(), MofNCompleteColumn())
        self.progress = Progress(*columns, TimeElapsedColumn(), console=Console(stderr=True))
        self.task = self.progress.add_task("", total=total)

    def __enter__(self):
        self.progress.start()
        return self.progress, self.task

    def __exit__(self, *exc):
        self.progress.stop()


def print_table(results: dict[str, Any]) -> None:
    files = results["files"]
    keys = list(next(iter(files.values())))
    table = Table(title=f"{results['model']} ({results['engine']}, verifier {results['verifier']})")
    table.add_column("file")
    for key in keys:
        table.add_column(key, justify="right")
    for name, metrics in files.items():
        table.add_row(Path(name).name, *(f"{metrics[k]:.0f}" if k == "problems" else f"{metrics[k]:.4f}" for k in keys))
    Console().print(table)
