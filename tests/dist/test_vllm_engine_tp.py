"""vLLM at engine TP=2 inside an SPMD program on the CPU (gloo): the engine's shards across two ranks decode
as the whole model does, and a training run with rollout.engine_tp_size=2 completes. The engine's ranks
all-reduce through shared memory named after the run (rollout/vllm_compat.py): two jobs on one host at once both
start, and a run whose earlier attempt was killed with its engine up starts again."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from dapo_mcore.rollout.base import EngineSettings, SamplingParams, run_instance_id
from dapo_mcore.rollout.registry import create_engine
from dapo_mcore.rollout.vllm_compat import psm_ledger
from tests.conftest import REPO, free_port, run_torchrun
from tests.e2e.test_train_cli import SHORT
from tests.engines.test_engine_contract import MODEL, PROMPTS
from tests.warm_cli import cli_env, start_warm

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


WORKER = REPO / "tests/dist/workers/vllm_engine_tp.py"
SHM = Path("/dev/shm")


def test_two_engine_tp2_jobs_at_once_both_start_and_decode_as_the_whole_model(tmp_path):
    """Both jobs' engines at once on this host: before, both named their shared memory after "env://" and the
    second failed "create shm in SHMManager failed. errno: 17"."""
    jobs = [start_ranks([str(MODEL), str(tmp_path / f"job{i}")], WORKER, timeout=400) for i in range(2)]
    for job in jobs:
        out, err = job.communicate()
        assert job.returncode == 0, out[-3000:] + err[-6000:]
    reference = create_engine("hf", EngineSettings(model_path=str(MODEL)))
    tokenizer = reference.inner.tokenizer
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    greedy = reference.generate(ids, SamplingParams(n=1, temperature=0.0, max_new_tokens=24))
    want = [g[0].token_ids.tolist() for g in greedy]
    for i in range(2):
        assert [torch.load(tmp_path / f"job{i}.{rank}.pt")["greedy"] for rank in range(2)] == [want, want]


def start_ranks(args: list[str], script: Path | None, timeout: int):
    """torchrun --nproc_per_node 2 [SCRIPT | -m dapo_mcore.cli] ARGS, not waited for (ranks forked from a warm server,
    a rendezvous port of its own)."""
    return start_warm(args, {**cli_env(), "MASTER_PORT": str(free_port())}, timeout, script=script, ranks=2)


def run_segments(run_dir: Path) -> list[Path]:
    return sorted(SHM.glob(f"{run_instance_id(run_dir)}-*"))


def test_training_with_engine_tp2_completes_after_an_attempt_killed_with_its_engine_up(tmp_path):
    """A SIGKILL leaves the engine's shared-memory segments behind (no teardown runs); the run's next attempt
    removes the ones of its own name and trains. Before, every later engine-TP-2 start on the host failed."""
    run_dir = tmp_path / "run"
    attempt = start_ranks(["train", *TP2_RUN, "trainer.steps=50", f"logging.run_dir={run_dir}"], None, timeout=400)
    deadline = time.monotonic() + 300
    while len(run_segments(run_dir)) < 2 and attempt.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    os.killpg(attempt.pid, signal.SIGKILL)
    attempt.wait(timeout=60)
    assert len(run_segments(run_dir)) == 2, attempt.communicate()[1][-4000:]  # one per rank, left behind
    # and vLLM's broadcast queue (/dev/shm/psm_*, 24 MiB, Python's random name): listed by the rank that made it
    ledgers = [psm_ledger(run_instance_id(run_dir), rank) for rank in range(2)]
    broadcast = [SHM / name for ledger in ledgers if ledger.exists() for name in ledger.read_text().split()]
    assert broadcast and all(segment.exists() for segment in broadcast)
    rows = train_at_engine_tp2(run_dir, "checkpoint.resume=auto")
    assert [r["step"] for r in rows] == [1, 2]
    # Both ranks of the engine group sent the same prompts (else the SPMD engine hangs or mixes them up), and
    # its answers' log-probs are the actor's.
    assert all(r["rollout/generated_samples"] > 0 and r["mismatch/abs_logp_diff_max"] < 1e-4 for r in rows)
    assert run_segments(run_dir) == []  # an engine shut down removes its own
    assert not any(segment.exists() for segment in broadcast + ledgers)  # the killed attempt's too


def test_partial_rollout_at_engine_tp2_stops_both_ranks_together_when_their_verifiers_disagree(tmp_path):
    """Rank 1's verifier times out on every answer rank 0's passes. Each rank judged on its own and stopped the
    round at its own count of kept groups: the rank that left vLLM's step loop left its peer waiting in the
    engine's TP all-reduce (a hang, here until the process group's timeout). Now rank 1 takes rank 0's verdicts
    and stop decisions (rollout/agreement.py): the run trains its steps with the same batch on both ranks."""
    rows = train_at_engine_tp2(
        tmp_path / "run",
        "rollout.partial_rollout=true",
        "rollout.gen_prompts_per_round=2",  # rounds of half the step's prompts: every step generates and judges
        "algorithm.reward.verifier=tests.verifiers:slow_on_rank_1",
        "algorithm.reward.timeout_s=0.5",
        "parallel.timeout_minutes=3",
        "parallel.generation_timeout_minutes=3",
        timeout=400,
    )
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["reward/timeouts"] == 0 for r in rows)  # rank 0's verdicts: none timed out
    assert all(r["rollout/accuracy"] > 0 and r["dynamic_sampling/kept_groups"] > 0 for r in rows)


def train_at_engine_tp2(run_dir, *overrides: str, timeout: int = 600) -> list[dict]:
    """A 2-step demo run on two processes, one vLLM engine at TP 2 across them, 4 prompts x 8 answers a step (the
    demo's 16 cost each rank 7 s of generation in the first step); its metrics rows."""
    args = ("train", *TP2_RUN, "trainer.steps=2", f"logging.run_dir={run_dir}", *overrides)
    run_torchrun(REPO / "dapo_mcore/cli.py", 2, *args, timeout=timeout)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# the demo with vLLM at engine TP 2, in short (test_train_cli.SHORT; each test sets its steps), quiet
TP2_RUN = (
    str(REPO / "examples/smoke_cpu.yaml"),
    "rollout.engine=vllm",
    "rollout.engine_tp_size=2",
    *SHORT,
    "logging.wandb.mode=disabled",
    "logging.progress=false",
)
