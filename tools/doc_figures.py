"""Figures quoted in the docs, kept equal everywhere they appear.

A figure that comes from a run (the demo's accuracy, the demo model's size, a command's time) is written
between markers, `<!-- fig:demo_acc_last5 -->0.927<!-- /fig -->`, in every place it is quoted; Markdown renders
only the text. tests/unit/test_docs.py fails when one name holds two texts, so a figure re-measured in one place
and not in another is caught. This tool lists them, checks them, rewrites one everywhere, and reads the demo's
figures from a run directory:

    python tools/doc_figures.py list
    python tools/doc_figures.py check
    python tools/doc_figures.py set demo_acc_last5 0.927
    python tools/doc_figures.py from-run runs/smoke_cpu      # the demo figures of that run, written everywhere
"""

from __future__ import annotations

import argparse
import json
import re
import struct
import sys
from collections import defaultdict
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
# The documents a user reads; recipes carry their docs in comments.
DOC_GLOBS = ("README.md", "CHANGELOG.md", "docs/**/*.md", "slurm/README.md", "examples/**/*.md", "tests/README.md")
FIGURE = re.compile(r"<!-- fig:(?P<name>[a-z0-9_]+) -->(?P<text>.*?)<!-- /fig -->")
# Rows of metrics.jsonl that hold a training step (a row may hold only a held-out evaluation).
ACCURACY_KEY = "rollout/accuracy"
LENGTH_KEY = "rollout/response_len_mean"
STEP_TIME_KEY = "time/step_s"
GENERATE_TIME_KEY = "time/generate_s"
UPDATE_TIME_KEY = "time/update_s"


def doc_files(repo: Path = REPO) -> list[Path]:
    found = {path for pattern in DOC_GLOBS for path in repo.glob(pattern) if path.is_file()}
    return sorted(found)


def figures(files: list[Path]) -> dict[str, dict[str, list[str]]]:
    """name -> text -> the places ("file:line") where that text is quoted."""
    found: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for match in FIGURE.finditer(line):
                found[match["name"]][match["text"]].append(f"{path.relative_to(REPO)}:{number}")
    return found


def disagreements(files: list[Path]) -> list[str]:
    """One line per figure quoted with two or more texts."""
    lines = []
    for name, texts in sorted(figures(files).items()):
        if len(texts) > 1:
            quoted = "; ".join(f"{text!r} at {', '.join(places)}" for text, places in texts.items())
            lines.append(f"figure {name} is quoted differently: {quoted}")
    return lines


def set_figure(files: list[Path], name: str, text: str) -> int:
    """Rewrite every quote of `name` to `text`; returns how many quotes there were."""
    pattern = re.compile(rf"(<!-- fig:{re.escape(name)} -->).*?(<!-- /fig -->)")
    total = 0
    for path in files:
        before = path.read_text()
        after, count = pattern.subn(lambda m: m[1] + text + m[2], before)
        if count:
            path.write_text(after)
            total += count
    return total


def safetensors_parameters(model_dir: Path) -> int:
    """Parameter count from the safetensors headers alone (no tensor is read)."""
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as stream:
            (header_len,) = struct.unpack("<Q", stream.read(8))
            header = json.loads(stream.read(header_len))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for size in entry["shape"]:
                    count *= size
                total += count
    return total


def demo_figures(run_dir: Path) -> dict[str, str]:
    """The README's demo figures from a run directory: accuracy and response length over the first and the
    last 5 training steps, the last step's accuracy, the mean times of a step, its generation and its update, and
    the model's parameter count."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [row for row in rows if ACCURACY_KEY in row]
    if len(steps) < 10:
        raise SystemExit(f"doc_figures: error: {run_dir} has {len(steps)} training steps; the demo figures need 10")
    first, last = steps[:5], steps[-5:]
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    model_dir = Path(config["model"]["hf_path"])
    model_dir = model_dir if model_dir.is_absolute() else REPO / model_dir

    def mean(block, key):
        return sum(row[key] for row in block) / len(block)

    return {
        "demo_acc_first5": f"{mean(first, ACCURACY_KEY):.3f}",
        "demo_acc_last5": f"{mean(last, ACCURACY_KEY):.3f}",
        "demo_acc_final": f"{steps[-1][ACCURACY_KEY]:.3f}",
        "demo_len_first5": f"{mean(first, LENGTH_KEY):.1f}",
        "demo_len_last5": f"{mean(last, LENGTH_KEY):.1f}",
        "demo_step_s": f"{mean(steps, STEP_TIME_KEY):.2f} s",
        "demo_generate_s": f"{mean(steps, GENERATE_TIME_KEY):.2f} s",
        "demo_update_s": f"{mean(steps, UPDATE_TIME_KEY):.2f} s",
        "demo_params": f"{safetensors_parameters(model_dir):,}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="every figure, its text and where it is quoted")
    commands.add_parser("check", help="exit 1 when a figure is quoted with two texts")
    setter = commands.add_parser("set", help="rewrite one figure everywhere")
    setter.add_argument("name")
    setter.add_argument("text")
    from_run = commands.add_parser("from-run", help="write the demo figures of a run directory everywhere")
    from_run.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    files = doc_files()
    if args.command == "list":
        for name, texts in sorted(figures(files).items()):
            for text, places in texts.items():
                print(f"{name} = {text!r}: {', '.join(places)}")
    elif args.command == "check":
        problems = disagreements(files)
        print("\n".join(problems) or f"{len(figures(files))} figures, each quoted the same everywhere")
        return 1 if problems else 0
    elif args.command == "set":
        if not set_figure(files, args.name, args.text):
            known = ", ".join(sorted(figures(files)))
            print(f"doc_figures: error: no figure named {args.name!r} in the docs (known: {known})", file=sys.stderr)
            return 2
        print(f"{args.name} = {args.text!r}")
    else:
        for name, text in demo_figures(args.run_dir).items():
            count = set_figure(files, name, text)
            print(f"{name} = {text!r}: {count} quote(s)" if count else f"{name} = {text!r}: quoted nowhere")
    return 0


if __name__ == "__main__":
    sys.exit(main())
