"""The other end of the Megatron-Core window (mcore/mcore_compat.py): megatron-core 0.19.2 on Python 3.12 (0.17+ need
it), while the main suite runs 0.16.1 on Python 3.11. Its own test environment (tests/dist/mcore_window/setup_env.sh,
cached outside the clone) runs a subset of the suite's own tests: the actor's gradients at TP 2, PP 2 and with the
distributed optimizer at DP 2 and TP 2 against one process, a save at TP 2 resumed at PP 2 (Megatron's resharding),
a run killed mid-step and resumed to identical metrics and weights, the HF -> mcore -> HF round trip with
check_conversion at TP 1 and 2 (a dense and a mixture-of-experts model), and a 2-step CLI run with saves; then a run
of the demo recipe that prints only its own lines, and `check`'s line of versions."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.dist.test_actor_parallel import WINDOW_TESTS as ACTOR_TESTS
from tests.e2e.test_train_cli import SHORT

MCORE, PYTHON, TORCH = "0.19.2", "3.12", "2.13.0"
SETUP = REPO / "tests/dist/mcore_window/setup_env.sh"
# Outside the clone, so that fresh clones reuse it while its inputs are unchanged (setup_env.sh checks them).
VENV = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dapo-mcore" / f"mcore-{MCORE}-py{PYTHON}"
CONVERSION = "tests/dist/test_conversion.py::test_hf_to_mcore_to_hf_is_bit_identical_and_check_conversion_passes_at_tp1"
WINDOW_TESTS = [
    *[f"tests/dist/test_actor_parallel.py::{name}" for name in ACTOR_TESTS],
    "tests/e2e/test_checkpoints.py::test_a_save_at_tp2_resumes_at_pp2_with_the_same_next_step",
    "tests/e2e/test_checkpoints.py::test_a_run_killed_mid_step_resumes_to_identical_metrics_and_weights[async]",
    f"{CONVERSION}_and_tp2[llama]",
    f"{CONVERSION}_and_tp2[qwen3_moe]",
    "tests/e2e/test_train_cli.py::test_steps_count_updates_done_in_the_console_metrics_saves_and_a_finished_rerun",
]
# The CUDA build of torch (the index's, for Python 3.12) says so once where there is no CUDA: not Megatron's line.
NO_CUDA_NOTE = re.compile(r"^(\[rank\d+\]:)?W\d+ [\d:.]+ \d+ torch/utils/cpp_extension\.py:\d+\] No CUDA runtime")


def python_3_12() -> str | None:
    """pyenv's Python 3.12 (ENVIRONMENT.md), else a python3.12 on PATH that runs (pyenv's shim refuses unless told)."""
    candidates = []
    try:
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True, timeout=30).stdout.strip()
        candidates += sorted(Path(root).glob(f"versions/{PYTHON}.*/bin/python"), reverse=True) if root else []
    except OSError:
        pass
    candidates += [found] if (found := shutil.which(f"python{PYTHON}")) else []
    for candidate in candidates:
        probe = subprocess.run([candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        if probe.returncode == 0 and probe.stdout.strip() == PYTHON:
            return str(candidate)
    return None


@pytest.fixture(scope="module")
def window_python() -> Path:
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU suite's second environment (a GPU machine's checks are tools/gpu_check.sh)")
    base = python_3_12()
    if base is None:
        pytest.skip(f"no Python {PYTHON} on this machine (megatron-core {MCORE} needs it)")
    env = {**os.environ, "UV": str(Path(sys.executable).parent / "uv")}
    built = subprocess.run(["bash", str(SETUP), str(VENV), base, MCORE, TORCH], capture_output=True, text=True,
                           timeout=1200, env=env)  # fmt: skip
    assert built.returncode == 0, (
        f"megatron-core {MCORE}'s test environment could not be built:\n{built.stderr[-4000:]}"
    )
    python = VENV / "bin/python"
    versions = subprocess.run([python, "-c", "import importlib.metadata as m, sys; "
                               "print(m.version('megatron-core'), '%d.%d' % sys.version_info[:2])"],
                              capture_output=True, text=True, check=True)  # fmt: skip
    assert versions.stdout.split() == [MCORE, PYTHON], versions.stdout  # the versions it is meant to test
    return python


def window_env(**extra: str) -> dict[str, str]:
    """The test process's environment less pytest's own variables (the inner pytest is a session of its own), with
    the clone first on the path; bytecode is written (into the cached environment: its next start is seconds
    faster, and Python's compile-time warnings are said once, at the first)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}


def test_megatron_core_0_19_keeps_the_layout_checkpoint_conversion_and_cli_tests(window_python, tmp_path):
    cmd = [str(window_python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'inner'}",
           *WINDOW_TESTS]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=REPO, env=window_env())
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.search(rf"\b{len(WINDOW_TESTS)} passed\b", summary) and "skipped" not in summary, proc.stdout[-3000:]


def test_a_run_on_megatron_core_0_19_prints_only_its_own_lines_and_check_names_the_versions(window_python, tmp_path):
    """Megatron-Core 0.17-0.19 log lines 0.16 did not (GPTModel's deprecation, DDP's layout, the background writer's
    deprecation) and import modules that warn (absl, MimoModelConfig): mcore_compat.NOTICES and parallel/state.py
    keep them out of a run's output. Python's default warnings filter, as a user's command."""
    from tests.e2e.test_quiet_output import foreign_lines

    run_dir = tmp_path / "run"
    cmd = [str(window_python), "-m", "dapo_mcore.cli", "train", "examples/smoke_cpu.yaml", *SHORT, "trainer.steps=2",
           "checkpoint.save_interval=1", "checkpoint.async_save=true", "logging.wandb.mode=disabled",
           "logging.progress=false", f"logging.run_dir={run_dir}"]  # fmt: skip
    env = window_env()
    env.pop("PYTHONWARNINGS", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert "checkpoint" in proc.stderr and "writing in the background" in proc.stderr
    assert foreign_lines(proc.stdout) == []
    assert [line for line in foreign_lines(proc.stderr) if not NO_CUDA_NOTE.match(line)] == [], proc.stderr[-3000:]
    check = subprocess.run([str(window_python), "-m", "dapo_mcore.cli", "check", "examples/smoke_cpu.yaml",
                            f"logging.run_dir={tmp_path / 'checked'}"], capture_output=True, text=True, timeout=300,
                           cwd=REPO, env=env)  # fmt: skip
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-3000:]
    line = check.stdout.splitlines()[1]
    assert line.startswith(f"  versions: Python {PYTHON}.") and f", torch {TORCH}" in line, check.stdout
    assert f"megatron-core {MCORE} (inside the tested window 0.16 to 0.19)" in line, check.stdout
