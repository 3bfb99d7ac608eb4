"""tools/prepare_data.py on small files in each published layout: good rows, each kind of bad row,
duplicates, held-out split. Parquet files are written with pyarrow, jsonl by hand."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo_mcore.data.datasets import load_jsonl_prompts
from dapo_mcore.data.published import convert_file
from dapo_mcore.data.tokenizer import build_char_tokenizer
from dapo_mcore.utils.errors import DataError
from dapo_mcore.utils.latex import last_boxed
from tools.prepare_data import main

DAPO_ROWS = [
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": 'Solve: 1+1. Remember to put your answer after "Answer:".'}],
        "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"},
    },
    {"prompt": [{"role": "user", "content": "What is 3^2?"}], "reward_model": {"ground_truth": "9"}},
]
GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 1,200 more.", "answer": "3 + 1200 = 1203\n#### 1,203"},
    {"question": "A debt of 5 grows by -7.", "answer": "5 - 7 = -2\n#### -2"},
]
MATH_ROWS = [
    {"problem": "Simplify $\\frac{2}{4}$.", "solution": "We get $\\boxed{\\frac{1}{2}}$."},
    {"problem": "Find $x$.", "solution": "So $x=\\boxed{\\{1, 2\\}}$ and not $\\boxed{3}$... fine: $\\boxed{4}$"},
]
MATH500_ROWS = [{"problem": "Compute $2+2$.", "solution": "It is 4.", "answer": "4", "level": 1}]
AIME_ROWS = [{"problem": "Find the remainder when 2024 is divided by 1000.", "answer": 24, "id": "2024-I-1"}]


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "rows, want",
    [
        (DAPO_ROWS, [('Solve: 1+1. Remember to put your answer after "Answer:".', "2"), ("What is 3^2?", "9")]),
        (GSM8K_ROWS, [("Tom has 3 apples and buys 1,200 more.", "1203"), ("A debt of 5 grows by -7.", "-2")]),
        (MATH_ROWS, [("Simplify $\\frac{2}{4}$.", "\\frac{1}{2}"), ("Find $x$.", "4")]),
        (MATH500_ROWS, [("Compute $2+2$.", "4")]),
        (AIME_ROWS, [("Find the remainder when 2024 is divided by 1000.", "24")]),
    ],
    ids=["dapo-math", "gsm8k", "math", "math-500", "aime"],
)
@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_each_published_layout_converts_from_parquet_and_jsonl(tmp_path, rows, want, fmt):
    write = write_parquet if fmt == "parquet" else write_jsonl
    path = write(tmp_path / f"data.{fmt}", rows)
    got = convert_file(path)
    assert [(r.prompt, r.answer) for r in got] == want
    assert [r.source for r in got] == [f"data.{fmt}:{i}" for i in range(1, len(want) + 1)]
    if rows is DAPO_ROWS:  # verl's data_source (a row's verifier) is kept where the row has it
        assert [r.carried for r in got] == [{"data_source": "math_dapo"}, {}]
        assert json.loads(got[0].to_json())["data_source"] == "math_dapo"


@pytest.mark.parametrize(
    "rows, layout, message",
    [
        ([DAPO_ROWS[0], {"prompt": [], "reward_model": {"ground_truth": "1"}}], None, "row 2: 'prompt' must be"),
        (
            [DAPO_ROWS[0], {"prompt": [{"role": "system", "content": "x"}], "reward_model": {"ground_truth": "1"}}],
            None,
            "row 2: 'prompt' has no message with role 'user'",
        ),
        ([DAPO_ROWS[0], {"prompt": DAPO_ROWS[0]["prompt"], "reward_model": {}}], None, "row 2: missing 'ground_truth'"),
        ([GSM8K_ROWS[0], {"question": "q", "answer": "no final line"}], None, "row 2: 'answer' does not end with"),
        ([MATH_ROWS[0], {"problem": "p", "solution": "no box here"}], None, "row 2: no 'answer' and no \\\\boxed"),
        ([MATH_ROWS[0], {"problem": "p", "solution": "unbalanced \\boxed{1"}], None, "row 2: no 'answer' and no"),
        ([AIME_ROWS[0], {"problem": "", "answer": 1}], None, "row 2: 'problem' must be a non-empty string"),
        ([AIME_ROWS[0], {"answer": 1, "problem": None}], "aime", "row 2: missing 'problem'"),
    ],
    ids=["empty-messages", "no-user", "no-truth", "no-####", "no-box", "unbalanced", "empty", "missing"],
)
def test_a_bad_row_is_an_error_naming_file_and_row(tmp_path, rows, layout, message):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError, match=message) as err:
        convert_file(path, layout)
    assert str(path) in str(err.value)


def test_unreadable_files_and_unknown_layouts_are_named(tmp_path):
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="broken.parquet: not a readable parquet file"):
        convert_file(tmp_path / "broken.parquet")
    (tmp_path / "bad.jsonl").write_text('{"problem": "p", "answer": 1}\n{oops\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        convert_file(tmp_path / "bad.jsonl")
    with pytest.raises(DataError, match="cannot tell the layout from the columns"):
        convert_file(write_jsonl(tmp_path / "other.jsonl", [{"text": "t", "label": 1}]))
    (tmp_path / "latin1.jsonl").write_bytes(b'{"problem": "p", "answer": 1}\n{"problem": "caf\xe9", "answer": 2}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl:2: not UTF-8 text"):
        convert_file(tmp_path / "latin1.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unknown file type '.csv'"):
        convert_file(tmp_path / "x.csv")


def test_last_boxed_takes_the_last_balanced_box():
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("none") is None


def test_the_tool_reports_duplicates_splits_heldout_and_writes_loadable_files(tmp_path, capsys):
    a = write_parquet(tmp_path / "a.parquet", AIME_ROWS + [{"problem": "Second problem.", "answer": 5, "id": "x"}])
    b = write_jsonl(
        tmp_path / "b.jsonl",
        [
            {"problem": "Find the remainder when 2024 is  divided by 1000.", "answer": 24},
            {"problem": "Third.", "answer": "x"},
        ],
    )
    out, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    code = main([str(a), str(b), "--out", str(out), "--heldout", "1", "--heldout-out", str(held)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "1 duplicate prompts left out" in printed and "b.jsonl:1 repeats a.parquet:1" in printed
    train, heldout = load_jsonl_prompts(out), load_jsonl_prompts(held)
    assert len(train) == 2 and len(heldout) == 1
    assert {p.text for p in train + heldout} == {AIME_ROWS[0]["problem"], "Second problem.", "Third."}
    assert main([str(a), str(b), "--out", str(out), "--keep-duplicates"]) == 0
    assert len(load_jsonl_prompts(out)) == 4


def test_the_tool_stops_on_a_bad_row_with_one_line_and_writes_nothing(tmp_path, capsys):
    bad = write_jsonl(tmp_path / "gsm.jsonl", [GSM8K_ROWS[0], {"question": "q", "answer": "nope"}])
    out = tmp_path / "train.jsonl"
    assert main([str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"prepare_data: error: {bad}: row 2: 'answer' does not end with '#### N'"]
    assert not out.exists()


def test_the_tool_can_wrap_each_problem_in_the_dapo_instruction(tmp_path):
    from dapo_mcore.data.templates import DAPO_PREFIX, DAPO_SUFFIX

    aime, out = write_jsonl(tmp_path / "aime.jsonl", AIME_ROWS), tmp_path / "aime.dapo.jsonl"
    assert main([str(aime), "--out", str(out), "--instruction", "dapo"]) == 0
    assert [p.text for p in load_jsonl_prompts(out)] == [DAPO_PREFIX + r["problem"] + DAPO_SUFFIX for r in AIME_ROWS]
    assert main([str(aime), "--out", str(out), "--instruction", "Q: {problem}"]) == 0
    assert load_jsonl_prompts(out)[0].text == "Q: " + AIME_ROWS[0]["problem"]
    assert main([str(aime), "--out", str(out), "--instruction", "bogus"]) == 2


def test_an_aime_file_prepared_with_the_instruction_carries_it_once_in_training_and_evaluation(tmp_path):
    from dapo_mcore.data.templates import DAPO_PREFIX, DAPO_SUFFIX, PromptFormatter

    aime, out = write_jsonl(tmp_path / "aime.jsonl", AIME_ROWS), tmp_path / "aime.dapo.jsonl"
    assert main([str(aime), "--out", str(out), "--instruction", "dapo"]) == 0
    problem = load_jsonl_prompts(out)[0].text
    # the run (data.instruction=dapo) or the eval (--instruction dapo) on the prepared file
    text = PromptFormatter(build_char_tokenizer(tmp_path / "tok"), instruction="dapo").text(problem)
    assert text == DAPO_PREFIX + AIME_ROWS[0]["problem"] + DAPO_SUFFIX
