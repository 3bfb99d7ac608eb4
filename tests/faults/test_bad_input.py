"""Bad input gives one line naming the file (and row), never a traceback or silence: over-long prompts under
each data.long_prompts policy, non-UTF-8 data, a run_dir that is a file, a damaged HF directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e.test_train_cli import SHORT, cli, read_rows

MODEL = REPO / "examples/models/tiny-arith"  # 128 positions; the demo's responses take up to 32 of them


def prompts_file(path: Path, long_row: bool = True) -> Path:
    rows = [{"prompt": f"What is {a}+{a}?\n", "answer": 2 * a} for a in range(8)]
    if long_row:
        rows.insert(1, {"prompt": "What is " + "1+" * 150 + "1?\n", "answer": 151})  # about 310 tokens
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def train(tmp_path: Path, *extra: str, expect: int = 0):
    return cli("train", "examples/smoke_cpu.yaml", *SHORT, "trainer.steps=1", "logging.wandb.mode=disabled",
               f"logging.run_dir={tmp_path / 'run'}", *extra, expect=expect)  # fmt: skip


def last_line(proc) -> str:
    return proc.stderr.strip().splitlines()[-1]


def test_an_over_long_prompt_is_an_error_naming_file_and_row_by_default(tmp_path):
    data = prompts_file(tmp_path / "long.jsonl")
    proc = train(tmp_path, f"data.source={data}", expect=2)
    assert last_line(proc).startswith("dapo-mcore: error: long.jsonl:2: the prompt is ")
    assert "longer than the 96 allowed (the model's 128 positions minus max_response_len)" in last_line(proc)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(("policy", "said"), [("drop", "left out"), ("truncate_left", "cut to their last tokens")])
def test_over_long_prompts_can_be_dropped_or_cut_and_are_counted(tmp_path, policy, said):
    data = prompts_file(tmp_path / "long.jsonl")
    proc = train(tmp_path, f"data.source={data}", f"data.long_prompts={policy}")
    assert "1 prompts longer than 96 tokens" in proc.stderr and said in proc.stderr
    assert len(read_rows(tmp_path / "run")) == 1


def test_non_utf8_data_is_one_line_naming_file_and_row(tmp_path):
    data = prompts_file(tmp_path / "bytes.jsonl", long_row=False)
    data.write_bytes(data.read_bytes().replace(b"What is 2+2", b"What is \xff+2", 1))
    proc = train(tmp_path, f"data.source={data}", expect=2)
    assert last_line(proc) == f"dapo-mcore: error: {data}:3: not UTF-8 text (byte 20: b'\\xff')"


def test_a_run_dir_that_is_a_file_is_one_line(tmp_path):
    (tmp_path / "run").write_text("not a directory")
    proc = train(tmp_path, expect=2)
    assert last_line(proc) == f"dapo-mcore: error: logging.run_dir: {tmp_path / 'run'} exists and is not a directory"


def test_a_damaged_hf_directory_is_one_line_naming_the_file(tmp_path):
    bad_json = shutil.copytree(MODEL, tmp_path / "bad-json")
    (bad_json / "config.json").write_text('{"model_type": "llama", ')
    proc = train(tmp_path, f"model.hf_path={bad_json}", expect=2)
    assert last_line(proc).startswith(f"dapo-mcore: error: {bad_json / 'config.json'} is not valid JSON")

    cut = shutil.copytree(MODEL, tmp_path / "cut")
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    proc = train(tmp_path, f"model.hf_path={cut}", expect=2)
    assert last_line(proc).startswith(f"dapo-mcore: error: {weights} is not a readable safetensors file")
