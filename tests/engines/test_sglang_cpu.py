"""SGLang on the CPU: the engine contract (test_engine_contract.py) run inside SGLang's own test environment.

SGLang's published wheel pins a CUDA torch; its offline Engine runs on these CPUs beside torch 2.13.0+cpu only
through two bridges (tests/engines/sglang_cpu/: a start-up bridge for torchvision and the CPU-engine switch,
and a stand-in sgl_kernel that raises on any call). That environment is built here, apart from .venv, and
the contract module runs in it for the sglang-cpu engine; the actor reference runs in this Python.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.engines.test_engine_contract import SGLANG_CPU_ENV

SETUP = REPO / "tests/engines/sglang_cpu/setup_env.sh"
# Outside the clone, so that fresh clones reuse it while its inputs are unchanged (setup_env.sh checks them).
VENV = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dapo-mcore" / "sglang-cpu"
# Skipped on SGLang's CPU build: the seed test (no seeded sampling) and the MoE test (its MoE layers do not
# start in this environment), docs/engines.md. Every other contract test run per engine must pass.
N_SKIPPED_ON_CPU = 2


def contract_tests_per_engine() -> int:
    """The contract tests that run once per engine (those taking the `engine` or `which` parameter), counted
    from the file, so that a new contract test is expected to pass here too without editing a number."""
    source = (REPO / "tests/engines/test_engine_contract.py").read_text()
    return len(re.findall(r"^def test_\w+\((?:engine|which)\b", source, flags=re.MULTILINE))


@pytest.fixture(scope="module")
def sglang_python():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs SGLang's own build (the sglang-cuda contract tests)")
    built = subprocess.run(["bash", str(SETUP), str(VENV)], capture_output=True, text=True, timeout=1200)
    if built.returncode != 0:
        pytest.skip(f"SGLang's CPU test environment could not be built:\n{built.stderr[-2000:]}")
    return VENV / "bin/python"


def test_sglang_keeps_the_engine_contract_on_the_cpu(sglang_python):
    env = {
        **os.environ,
        SGLANG_CPU_ENV: "1",
        "DAPO_ACTOR_PYTHON": sys.executable,
        "DAPO_SGLANG_STUBS": str(REPO / "tests/engines/sglang_cpu/stubs"),
        "PYTHONPATH": str(REPO),
    }
    cmd = [str(sglang_python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-s", "-k", "sglang-cpu"]
    cmd.append(str(REPO / "tests/engines/test_engine_contract.py"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=REPO, env=env)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    passing = contract_tests_per_engine() - N_SKIPPED_ON_CPU
    assert re.search(rf"\b{passing} passed, {N_SKIPPED_ON_CPU} skipped\b", proc.stdout), proc.stdout[-2000:]
