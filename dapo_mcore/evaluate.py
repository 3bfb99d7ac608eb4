"""`dapo-mcore eval`: avg@k, pass@k and maj@k of a model on prompt files, with any engine.

The same pieces as training (engine registry, prompt formats, verifier pool), never a second copy: a
prompt file's problems are formatted, k answers are sampled per problem, each is checked by the verifier,
and the metrics of algo/eval_metrics.py are computed per file. Results go to a JSON file and a table.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from dapo_mcore.algo.eval_metrics import avg_at_k, maj_at_k, pass_at_k
from dapo_mcore.data.datasets import load_jsonl_prompts
from dapo_mcore.data.templates import PromptFormatter
from dapo_mcore.data.types import Prompt
from dapo_mcore.rewards.answers import answer_extractor
from dapo_mcore.rewards.pool import VerifierPool
from dapo_mcore.rollout.base import EngineSettings, RolloutEngine, SamplingParams
from dapo_mcore.rollout.registry import create_engine
from dapo_mcore.utils.errors import ConfigError


@dataclass(frozen=True)
class EvalSettings:
    k: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 1024
    seed: int = 0
    prompts_per_call: int = 16


def evaluate_file(
    engine: RolloutEngine,
    encode: Callable[[str], Any],
    prompts: list[Prompt],
    verify: Callable[[list[tuple[str, str]]], list[Any]],
    extract: Callable[[str], str | None],
    settings: EvalSettings,
    on_progress: Callable[[int], None] = lambda n: None,
) -> dict[str, float]:
    """k answers per prompt from the engine, checked by `verify`; returns the file's metrics."""
    correct, answers = [], []
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
        verdicts = verify([(c.text, p.answer) for p, group in zip(chunk, groups) for c in group])
        for i, group in enumerate(groups):
            correct.append([v.correct for v in verdicts[i * settings.k : (i + 1) * settings.k]])
            answers.append([extract(c.text) for c in group])
        on_progress(len(chunk))
    return metrics_of(correct, answers, settings.k)


def metrics_of(correct: list[list[bool]], answers: list[list[str | None]], k: int) -> dict[str, float]:
    out = {"problems": float(len(correct)), f"avg@{k}": avg_at_k(correct), f"maj@{k}": maj_at_k(answers, correct, k)}
    for j in _pass_ks(k):
        out[f"pass@{j}"] = pass_at_k(correct, j)
    return out


def _pass_ks(k: int) -> list[int]:
    """1, 2, 4, ... up to k, and k itself."""
    ks, j = [], 1
    while j < k:
        ks.append(j)
        j *= 2
    return [*ks, k]


def run_eval(
    model: str,
    files: list[str],
    engine_name: str,
    verifier: str,
    settings: EvalSettings,
    template: str = "none",
    instruction: str = "none",
    device: str = "cpu",
    dtype: str = "float32",
    out: str | None = None,
) -> dict[str, Any]:
    from transformers import AutoTokenizer

    if not (Path(model) / "config.json").is_file():
        raise ConfigError(
            f"{model} is not an HF model directory (no config.json); convert a Megatron checkpoint or run save "
            "first: python tools/convert_mcore_to_hf.py CKPT OUT_DIR"
        )
    prompt_sets = {name: load_jsonl_prompts(name) for name in files}  # every file checked before generating
    encode = PromptFormatter(AutoTokenizer.from_pretrained(model), template, instruction)
    engine = create_engine(engine_name, EngineSettings(model_path=model, device=device, dtype=dtype))
    pool = VerifierPool(verifier, workers=1)
    results: dict[str, Any] = {"model": model, "engine": engine_name, "verifier": verifier, "files": {}}
    results["settings"] = settings.__dict__ | {"template": template, "instruction": instruction}
    try:
        with _progress(sum(len(p) for p in prompt_sets.values())) as (progress, task):
            for name, prompts in prompt_sets.items():
                progress.update(task, description=Path(name).name)
                results["files"][name] = evaluate_file(
                    engine, encode, prompts, pool.verify, answer_extractor(verifier), settings,
                    on_progress=lambda n: progress.advance(task, n),
                )  # fmt: skip
    finally:
        pool.close()
        engine.shutdown()
    if out:
        Path(out).write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    return results


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
