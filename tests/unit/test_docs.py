"""The docs can be trusted: every repository file they name exists, and a figure quoted in several places (between
`<!-- fig:NAME -->` markers, tools/doc_figures.py) reads the same in each."""

import re
from pathlib import Path

import pytest

from tools import doc_figures
from tools.doc_figures import REPO, demo_figures, disagreements, doc_files, figures, set_figure

TOP_DIRS = ("docs", "tools", "examples", "slurm", "dapo_mcore", "tests")
# A repository path in prose: starts at a top-level directory, not inside a longer path or URL.
REPO_PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(TOP_DIRS) + r")/[\w./-]*[\w/])")
# Files that live outside the repository (the project's notes); a reader cannot open them.
OUTSIDE_FILES = re.compile(r"(?<![\w./-])(REFERENCE\.md|DESIGN\.md)")
MARKDOWN_LINK = re.compile(r"\]\(([^)#\s]+)")
# The project's own bookkeeping, which says nothing to a reader: which ticket or work stop a change came from.
INTERNAL_WORDS = re.compile(r"\bissues? \d+|\bat stop \d+|\bstop \d+(?=[)\]:;,'])|\bthis session\b", flags=re.I)


def recipe_comment_lines(path: Path) -> list[str]:
    return [line[line.index("#") :] if "#" in line else "" for line in path.read_text().splitlines()]


def documents() -> list[tuple[Path, list[str]]]:
    """Every doc with its lines; recipes contribute their comments only."""
    docs = [(path, path.read_text().splitlines()) for path in doc_files()]
    recipes = [(path, recipe_comment_lines(path)) for path in sorted(REPO.glob("examples/**/*.yaml"))]
    return docs + recipes


def broken_references(path: Path, lines: list[str]) -> list[str]:
    found = []
    for number, line in enumerate(lines, start=1):
        where = f"{path.relative_to(REPO)}:{number}"
        found += [f"{where}: {m[1]}" for m in REPO_PATH.finditer(line) if not (REPO / m[1].rstrip(".")).exists()]
        found += [f"{where}: {m[1]} is not in the repository" for m in OUTSIDE_FILES.finditer(line)]
        links = [m[1] for m in MARKDOWN_LINK.finditer(line) if not re.match(r"[a-z]+:", m[1])]
        found += [f"{where}: link {target}" for target in links if not (path.parent / target).exists()]
    return found


def test_every_repository_file_the_docs_and_recipes_name_exists():
    broken = [line for path, lines in documents() for line in broken_references(path, lines)]
    assert not broken, "\n".join(broken)


def test_the_docs_say_what_changed_not_which_ticket_or_stop_it_came_from():
    found = [
        f"{path.relative_to(REPO)}:{number}: {match[0]}"
        for path, lines in documents()
        for number, line in enumerate(lines, start=1)
        for match in INTERNAL_WORDS.finditer(line)
    ]
    assert not found, "\n".join(found)


def test_the_reference_check_catches_a_missing_file_a_bare_outside_note_and_a_dead_link(tmp_path):
    lines = [
        "see docs/gpu.md and tools/doc_figures.py, (examples/smoke_cpu.yaml).",
        "see docs/no_such_page.md and REFERENCE.md section 1",
        "[engines](engines_gone.md), [site](https://example.org/x.md)",
    ]
    broken = broken_references(REPO / "docs" / "any.md", lines)
    assert [line.split(": ", 1)[1] for line in broken] == [
        "docs/no_such_page.md",
        "REFERENCE.md is not in the repository",
        "link engines_gone.md",
    ]


def test_every_figure_is_quoted_the_same_everywhere():
    assert not disagreements(doc_files()), "\n".join(disagreements(doc_files()))
    # The figures that come from the demo run are marked, so the check above covers them.
    assert {"demo_acc_last5", "demo_params", "demo_time", "tiny_eval_avg8"} <= set(figures(doc_files()))


@pytest.fixture
def two_docs(tmp_path) -> list[Path]:
    first, second = tmp_path / "a.md", tmp_path / "b.md"
    first.write_text("accuracy <!-- fig:demo_acc_last5 -->0.874<!-- /fig --> in the README\n")
    second.write_text("went to <!-- fig:demo_acc_last5 -->0.878<!-- /fig -->, and <!-- fig:x -->1<!-- /fig -->\n")
    return [first, second]


def test_a_figure_quoted_differently_in_two_places_is_named_with_both_texts(two_docs, monkeypatch):
    monkeypatch.setattr(doc_figures, "REPO", two_docs[0].parent)
    (problem,) = disagreements(two_docs)
    assert problem.startswith("figure demo_acc_last5 is quoted differently: '0.874' at a.md:1; '0.878' at b.md:1")


def test_set_rewrites_a_figure_everywhere_and_leaves_the_others(two_docs, monkeypatch):
    monkeypatch.setattr(doc_figures, "REPO", two_docs[0].parent)
    assert set_figure(two_docs, "demo_acc_last5", "0.927") == 2
    assert not disagreements(two_docs)
    assert "went to <!-- fig:demo_acc_last5 -->0.927<!-- /fig -->, and <!-- fig:x -->1<!-- /fig -->" in (
        two_docs[1].read_text()
    )


def test_from_run_reads_the_demo_figures_from_metrics_and_counts_the_models_parameters(tmp_path):
    rows = [{"step": 0, "eval/held/avg@4": 0.5}]  # an evaluation-only row is not a training step
    rows += [
        {"step": s, "rollout/accuracy": s / 10, "rollout/response_len_mean": 20.0 - s}
        | {"time/step_s": 1.0, "time/generate_s": 0.5, "time/update_s": 0.25}
        for s in range(1, 11)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(f"{row}\n".replace("'", '"') for row in rows))
    (tmp_path / "config.yaml").write_text("model:\n  hf_path: examples/models/tiny-arith\n")
    assert demo_figures(tmp_path) == {
        "demo_acc_first5": "0.300",
        "demo_acc_last5": "0.800",
        "demo_acc_final": "1.000",
        "demo_len_first5": "17.0",
        "demo_len_last5": "12.0",
        "demo_step_s": "1.00 s",
        "demo_generate_s": "0.50 s",
        "demo_update_s": "0.25 s",
        "demo_params": "136,000",  # hidden 64, 2 layers, untied 100-token embeddings (its README)
    }
