"""Write or check the tested sets' locks (requirements/<set>.txt, dapo_mcore/utils/install.py SETS) with uv.

    python tools/lock_sets.py                  # resolve each requirements/<set>.in (with pyproject.toml) anew
    python tools/lock_sets.py --check [SET]    # each lock resolves as one environment from its documented line

--check resolves what the documented install line asks for (pyproject.toml with the set's extras, constrained by
the lock) for Linux x86_64 and Python 3.12, and fails unless the result is the lock itself: the lock's pins
agree with each other, with the project's own ranges and with the package index. It needs uv (make setup installs
it into .venv), a Python 3.12 (pyenv's on these machines) and the index; exit 3 when the index cannot be reached.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dapo_mcore.utils.install import SETS, InstallSet  # noqa: E402

UNREACHABLE_EXIT = 3


def python312() -> str:
    """A Python 3.12 interpreter to resolve for (uv reads its tags and markers)."""
    found = shutil.which("python3.12")
    pyenv = subprocess.run(["pyenv", "root"], capture_output=True, text=True) if shutil.which("pyenv") else None
    if pyenv is not None and pyenv.returncode == 0:
        candidate = Path(pyenv.stdout.strip()) / "versions" / "3.12.1" / "bin" / "python"
        if candidate.exists():
            return str(candidate)
    if found:
        return found
    sys.exit("lock_sets: no Python 3.12 found (python3.12 on PATH, or pyenv's 3.12.1)")


def uv() -> str:
    for candidate in (REPO / ".venv" / "bin" / "uv", Path(sys.executable).parent / "uv"):
        if candidate.exists():
            return str(candidate)
    return shutil.which("uv") or sys.exit("lock_sets: uv not found (make setup installs it into .venv)")


def compile_set(s: InstallSet, out: Path, inputs: list[str], constraint: str | None = None) -> None:
    cmd = [uv(), "pip", "compile", "pyproject.toml", *inputs, "--extra", "gpu", "--extra", s.engine,
           "--python", python312(), "--python-platform", s.platform, "--quiet", "-o", str(out),
           "--custom-compile-command", f"python tools/lock_sets.py {s.name}"]  # fmt: skip
    if constraint:
        cmd += ["-c", constraint]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "UV_NO_PROGRESS": "1"})
    if done.returncode != 0:
        unreachable = any(w in done.stderr for w in ("dns error", "Connect", "failed to lookup address"))
        print(f"lock_sets: {s.name}: {done.stderr.strip()[-2000:]}", file=sys.stderr)
        sys.exit(UNREACHABLE_EXIT if unreachable else 1)


def pins(path: Path) -> list[str]:
    """The lock's requirement lines, without uv's comments."""
    return sorted(line.strip() for line in path.read_text().splitlines() if line.strip() and line[0] not in "# ")


def write(s: InstallSet) -> None:
    compile_set(s, Path(s.lock), [f"requirements/{s.name}.in"])  # relative to the checkout (cwd)
    print(f"wrote {s.lock}: {len(pins(REPO / s.lock))} packages")


def check(s: InstallSet, lock: Path | None = None) -> bool:
    """Whether what the documented line asks for resolves, under the lock (`lock`: another file), to the lock."""
    lock = lock or REPO / s.lock
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "resolved.txt"
        compile_set(s, out, [], constraint=str(lock))
        got, want = pins(out), pins(lock)
    if got != want:
        print(f"{s.name}: the documented line resolves to another set than {s.lock}:", file=sys.stderr)
        print("  only in the lock: " + ", ".join(sorted(set(want) - set(got))), file=sys.stderr)
        print("  only resolved:    " + ", ".join(sorted(set(got) - set(want))), file=sys.stderr)
        return False
    print(f"{s.name}: resolves to its lock ({len(want)} packages)")
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="check the locks instead of writing them")
    ap.add_argument("sets", nargs="*", help=f"set names (default: all): {', '.join(s.name for s in SETS)}")
    args = ap.parse_args()
    if unknown := set(args.sets) - {s.name for s in SETS}:
        ap.error(f"unknown sets {sorted(unknown)}; the sets: {', '.join(s.name for s in SETS)}")
    chosen = [s for s in SETS if not args.sets or s.name in args.sets]
    if not args.check:
        for s in chosen:
            write(s)
        return 0
    return 0 if all([check(s) for s in chosen]) else 1


if __name__ == "__main__":
    sys.exit(main())
