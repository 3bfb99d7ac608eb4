"""What the model generated, as a user finds it: samples/ of a short demo run, `eval --save-answers`."""

import json

from tests.conftest import REPO
from tests.e2e.test_train_cli import SHORT, cli

ROW_KEYS = {"step", "prompt", "answer", "ground_truth", "correct", "reward", "advantage", "finish_reason",
            "response_len", "prompt_len", "group", "weight_versions"}  # fmt: skip


def test_a_two_step_run_writes_each_steps_answers_readable_as_json(tmp_path):
    run_dir = tmp_path / "run"
    cli("train", "examples/smoke_cpu.yaml", *SHORT, "trainer.steps=2", f"logging.run_dir={run_dir}",
        "logging.wandb.mode=disabled")  # fmt: skip
    files = sorted((run_dir / "samples").iterdir())
    assert [f.name for f in files] == ["step_000001.jsonl", "step_000002.jsonl"]
    for step, path in enumerate(files, start=1):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(rows) == 4 and all(set(r) >= ROW_KEYS and r["step"] == step for r in rows)  # the default 4
        assert all(r["prompt"].startswith("What is ") and r["answer"] for r in rows)  # decoded by the tokenizer
        assert all(r["response_len"] > 0 and r["weight_versions"] == [[step - 1, r["response_len"]]] for r in rows)
        assert len({r["group"] for r in rows}) == 1 and {r["correct"] for r in rows} == {True, False}


def test_eval_save_answers_writes_one_row_per_answer(tmp_path):
    data, answers = tmp_path / "sums.jsonl", tmp_path / "answers.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {a}+{a + 1}?\n", "answer": 2 * a + 1}) + "\n"
                            for a in range(3)))  # fmt: skip
    cli("eval", str(REPO / "examples/models/tiny-arith"), "--data", str(data), "--k", "4", "--max-new-tokens", "32",
        "--save-answers", str(answers))  # fmt: skip
    rows = [json.loads(line) for line in answers.read_text().splitlines()]
    assert [(r["index"], r["sample"]) for r in rows] == [(i, j) for i in range(3) for j in range(4)]
    assert all(r["file"] == str(data) and r["prompt"] == f"What is {r['index']}+{r['index'] + 1}?\n" for r in rows)
    assert all(r["ground_truth"] == str(2 * r["index"] + 1) and r["finish_reason"] in ("stop", "length") for r in rows)
    assert all(r["correct"] == (r["extracted"] == r["ground_truth"]) for r in rows)
