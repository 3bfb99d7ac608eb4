"""docs/gpu.md from a fresh checkout to `sbatch`, on the CPU: the commands of its blocks marked `checked` run as
written, with stand-ins for what cannot be had here (the published data files, in their published layout;
the tiny demo model in place of Qwen2.5-7B), and every file the 7B recipe reads is then in place."""

import os
import re
import shlex
import subprocess
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo_mcore.data.templates import DAPO_PREFIX, DAPO_SUFFIX
from tests.warm_cli import cli_env, run_warm

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "gpu.md"


def checked_blocks() -> dict[str, list[str]]:
    """name -> the commands of the ```bash block after each `<!-- checked: name -->` (continuations joined)."""
    blocks = re.findall(r"<!-- checked: (\w+) -->\n```bash\n(.*?)```", DOC.read_text(), flags=re.S)
    return {name: [c.strip() for c in body.replace("\\\n", " ").splitlines() if c.strip()] for name, body in blocks}


def dapo_rows(problems: list[tuple[str, str]]) -> list[dict]:
    """Rows as DAPO-Math-17k and the authors' AIME-2024 lay them out: the instruction inside the user turn."""
    return [
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": DAPO_PREFIX + problem + DAPO_SUFFIX}],
            "ability": "MATH",
            "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
        }
        for problem, answer in problems
    ]


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A working directory laid out as the repository (its tools, recipes and scripts), the published files
    where docs/gpu.md downloads them, and the tiny model where the recipe's Qwen2.5-7B goes."""
    for name in ("tools", "examples", "slurm"):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "Qwen2.5-7B").symlink_to(REPO / "examples" / "models" / "tiny-arith")
    downloads = tmp_path / "downloads"
    train = [(f"What is {a} + {a + 1}?", str(2 * a + 1)) for a in range(20)]
    aime = [(f"Find the remainder when {2000 + i} is divided by 7.", str((2000 + i) % 7)) for i in range(3)]
    for path, rows in (
        (downloads / "DAPO-Math-17k" / "data" / "dapo-math-17k.parquet", dapo_rows(train)),
        (downloads / "AIME-2024" / "data" / "aime-2024.parquet", dapo_rows(aime) * 4),  # repeated, as published
    ):
        path.parent.mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(rows), path)
    return tmp_path


def run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """The doc's command in `cwd` ($DOWNLOADS as its block exports it); `python SCRIPT` and `dapo-mcore` fork from
    a warm server (tests/warm_cli.py), anything else runs as it is."""
    argv = [os.path.expandvars(a).replace("$DOWNLOADS", "downloads") for a in shlex.split(command)]
    if argv[0] == "dapo-mcore":
        return run_warm(argv[1:], cli_env(), 120, cwd=cwd)
    if argv[0] == "python" and argv[1].endswith(".py"):
        return run_warm(argv[2:], cli_env(), 120, script=cwd / argv[1], cwd=cwd)
    env = {**os.environ, "DOWNLOADS": "downloads", "PYTHONPATH": str(REPO)}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def launch_check(command: str) -> str:
    """The `dapo-mcore check` of what an sbatch line would run: its config and overrides."""
    argv = shlex.split(command)
    return "dapo-mcore check " + shlex.join(argv[argv.index("slurm/train.sbatch") + 1 :])


def test_following_the_gpu_doc_reaches_sbatch_with_every_file_the_recipe_reads(checkout):
    blocks = checked_blocks()
    assert set(blocks) == {"prepare", "launch"}, "docs/gpu.md lost a checked block"
    for command in blocks["prepare"]:
        done = run(command, checkout)
        assert done.returncode == 0, f"{command}\n{done.stdout}{done.stderr}"
    aime = (checkout / "data" / "aime24.jsonl").read_text().splitlines()
    assert len(aime) == 3 and all(line.count("Solve the following math problem") == 1 for line in aime)
    sbatch = [c for c in blocks["launch"] if c.startswith("sbatch")]
    assert len(sbatch) == 1 and (checkout / "slurm" / "train.sbatch").is_file()
    for command in [c for c in blocks["launch"] if not c.startswith("sbatch")] + [launch_check(sbatch[0])]:
        done = run(command, checkout)
        assert done.returncode == 0, f"{command}\n{done.stdout}{done.stderr}"
    assert "is ready to launch" in run(launch_check(sbatch[0]), checkout).stdout


def test_the_check_names_the_file_a_skipped_step_would_have_made(checkout):
    check = launch_check(next(c for c in checked_blocks()["launch"] if c.startswith("sbatch")))
    run(checked_blocks()["prepare"][0], checkout)  # the training prompts, not the AIME file
    done = run(check, checkout)
    assert done.returncode == 2 and "data.eval_files: file not found: data/aime24.jsonl" in done.stderr
