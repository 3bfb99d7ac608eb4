"""The README's `dapo-mcore eval` line, run as written, prints the figures the README and docs/evaluation.md quote
(between `<!-- fig:tiny_eval_* -->` markers, tools/doc_figures.py)."""

import json
import re
import shlex

from tests.conftest import REPO
from tests.e2e.test_train_cli import cli
from tools.doc_figures import doc_files, figures

# The README's example on the demo model before any training (about 10 s of generation on 2 cores).
README_EVAL = re.compile(r"^dapo-mcore eval (examples/models/tiny-arith .*)$", flags=re.M)
DOCS_EVAL = re.compile(r"`dapo-mcore eval MODEL (--data [^`]*)`")


def readme_eval_args() -> list[str]:
    (command,) = README_EVAL.findall((REPO / "README.md").read_text())
    return shlex.split(command)


def quoted(name: str) -> float:
    (text,) = figures(doc_files())[name]  # tests/unit/test_docs.py: one text wherever it is quoted
    return float(text)


def test_the_readme_eval_command_prints_the_figures_the_docs_quote(tmp_path):
    args = readme_eval_args()
    docs_command = DOCS_EVAL.search((REPO / "docs" / "evaluation.md").read_text())[1]
    assert shlex.split(docs_command) == args[1:], "docs/evaluation.md quotes another command than the README"
    out = tmp_path / "eval.json"
    proc = cli("eval", *args, "--out", str(out))
    (scores,) = json.loads(out.read_text())["files"].values()
    for metric, name in (("avg@8", "tiny_eval_avg8"), ("maj@8", "tiny_eval_maj8"), ("pass@8", "tiny_eval_pass8")):
        assert round(scores[metric], 3) == quoted(name), (metric, scores[metric], quoted(name))
        assert f"{scores[metric]:.4f}" in proc.stdout  # the table the user reads shows the same figure
    assert scores["avg@8"] > 0  # the untrained model's answers are sampled widely enough to score
