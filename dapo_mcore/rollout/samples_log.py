"""What the model generated: a few of each step's answers, readable, in the run directory (logging.samples_per_step).

After each step's rollout, rank 0 writes N of the answers it holds to samples/step_000K.jsonl (K: the step,
updates completed once it ends), one JSON object per answer: the prompt and answer as text, the ground truth,
the verdict and reward, the advantage, how the answer ended, its lengths, its group and the weights that
generated it. The same rows go to a wandb table when wandb is on.

Rank 0 writes only what it holds: after the exchange each answer's tokens live on the ranks that train it
(rollout/exchange.py), and the others are only counts (data/types.py NotHere). Gathering them for a log
would move the step's tokens a second time, so at DP > 1 the choice is made among rank 0's share.

The choice is deterministic and shows what the update learns from: whole kept groups in batch order, those
with both right and wrong answers first, their answers alternately right and wrong, so that N = 4 of a
group of 8 shows two of each rather than four draws that may all agree.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dapo_mcore.data.types import Group, Sample

SAMPLES_DIR = "samples"
ROLLED_BACK_DIR = "rolled_back"


def step_file(samples_dir: Path, step: int) -> Path:
    return Path(samples_dir) / f"step_{step:06d}.jsonl"


def log_step_samples(
    groups: Sequence[Group],
    step: int,
    n: int,
    tokenizer: Any,
    samples_dir: Path,
    table: Callable[[int, list[dict[str, Any]]], None] | None = None,
) -> Path | None:
    """Write up to `n` of the step's answers held here to samples_dir/step_<step>.jsonl (n = 0: nothing) and
    hand the rows to `table` (MetricsWriter.log_table). tokenizer: the HF tokenizer (decode). Returns the file."""
    if n <= 0:
        return None
    rows = [sample_row(groups[g], i, g, step, tokenizer) for g, i in choose_samples(groups, n)]
    path = write_step_file(Path(samples_dir), step, rows)
    if table is not None and rows:
        table(step, rows)
    return path


def choose_samples(groups: Sequence[Group], n: int) -> list[tuple[int, int]]:
    """(group position, answer position) of up to n held answers: groups with right and wrong answers first,
    then the others, each in batch order; within a group right and wrong alternately. Sorted by position."""
    mixed = [g for g, group in enumerate(groups) if len({group.samples[i].correct for i in _held(group)}) == 2]
    others = [g for g in range(len(groups)) if g not in set(mixed)]
    chosen: list[tuple[int, int]] = []
    for g in mixed + others:
        if len(chosen) >= n:
            break
        chosen += [(g, i) for i in _alternating_verdicts(groups[g].samples, _held(groups[g]))]
    return sorted(chosen[:n])


def _held(group: Group) -> list[int]:
    return [i for i, sample in enumerate(group.samples) if sample.held]


def _alternating_verdicts(samples: Sequence[Sample], positions: list[int]) -> list[int]:
    """Positions ordered right, wrong, right, wrong, ... (then the rest of the larger side)."""
    right = [i for i in positions if samples[i].correct]
    wrong = [i for i in positions if not samples[i].correct]
    paired = [i for pair in zip(right, wrong) for i in pair]
    shorter = min(len(right), len(wrong))
    return paired + right[shorter:] + wrong[shorter:]


def sample_row(group: Group, i: int, group_position: int, step: int, tokenizer: Any) -> dict[str, Any]:
    """One answer as a JSON-ready dict. weight_versions: [[v, n_tokens], ...] in token order, v the number of
    updates behind the weights that generated those tokens (several runs: an answer continued by later
    weights, partial rollout)."""
    sample = group.samples[i]
    return {
        "step": step,
        "group": group_position,
        "sample": i,
        "prompt_uid": group.prompt.uid,
        "prompt": tokenizer.decode(_ids(sample.prompt_ids), skip_special_tokens=False),
        # as the engines return it to the verifier (their text skips special tokens)
        "answer": tokenizer.decode(_ids(sample.response_ids), skip_special_tokens=True),
        "ground_truth": group.prompt.answer,
        "data_source": group.prompt.data_source,
        "correct": bool(sample.correct),
        "timed_out": bool(sample.timed_out),
        "verifier_reward": float(sample.verifier_reward),  # the reward before the length shaping
        "reward_parts": dict(sample.reward_parts),
        "reward": float(sample.reward),
        "length_penalty": float(sample.length_penalty),
        "advantage": float(sample.advantage),
        "trainable": bool(sample.trainable),
        "finish_reason": sample.finish_reason,
        "response_len": sample.response_len,
        "prompt_len": len(sample.prompt_ids),
        "weight_versions": [[int(v), int(n)] for v, n in sample.token_versions()],
    }


def _ids(ids) -> list[int]:
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


def write_step_file(samples_dir: Path, step: int, rows: list[dict[str, Any]]) -> Path:
    """samples_dir/step_<step>.jsonl. A file of this step exists only when the run resumed from an earlier save
    and runs the step again: that file and those of later steps are the trajectory it left, and move to
    rolled_back/ (as metrics.jsonl's rows do: nothing is deleted) before the step is written anew."""
    samples_dir.mkdir(parents=True, exist_ok=True)
    if step_file(samples_dir, step).exists():
        _roll_back_from(samples_dir, step)
    path = step_file(samples_dir, step)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
        tmp.replace(path)
    except OSError:  # a full disk or a quota: no partial file left behind (the caller warns, naming the path)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise
    return path


def _roll_back_from(samples_dir: Path, step: int) -> None:
    """Into rolled_back/<time>/: a second resume from the same save leaves the first one's files alone."""
    rolled_back = samples_dir / ROLLED_BACK_DIR / time.strftime("%Y%m%d-%H%M%S")
    rolled_back.mkdir(parents=True, exist_ok=True)
    for path in samples_dir.glob("step_*.jsonl"):
        if _step_of(path) >= step:
            path.replace(rolled_back / path.name)


def _step_of(path: Path) -> int:
    try:
        return int(path.stem.removeprefix("step_"))
    except ValueError:
        return -1


def read_step_samples(samples_dir: Path, step: int) -> list[dict[str, Any]]:
    with step_file(samples_dir, step).open() as fh:
        return [json.loads(line) for line in fh if line.strip()]
