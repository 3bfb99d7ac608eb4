"""vLLM at engine TP=2 inside an SPMD program on the CPU (gloo): the engine's shards across two ranks decode
as the whole model does, and a training run with rollout.engine_tp_size=2 completes."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from dapo_mcore.rollout.base import EngineSettings, SamplingParams
from dapo_mcore.rollout.registry import create_engine
from tests.conftest import REPO, run_torchrun
from tests.engines.test_engine_contract import MODEL, PROMPTS

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")


def test_engine_tp2_after_a_push_decodes_as_the_whole_model(tmp_path):
    run_torchrun(REPO / "tests/dist/workers/vllm_engine_tp.py", 2, str(MODEL), str(tmp_path / "greedy"))
    ranks = [torch.load(tmp_path / f"greedy.{rank}.pt")["greedy"] for rank in range(2)]
    reference = create_engine("hf", EngineSettings(model_path=str(MODEL)))
    tokenizer = reference.inner.tokenizer
    ids = [tokenizer(p).input_ids for p in PROMPTS]
    greedy = reference.generate(ids, SamplingParams(n=1, temperature=0.0, max_new_tokens=24))
    want = [g[0].token_ids.tolist() for g in greedy]
    assert ranks[0] == ranks[1] == want


def test_training_with_engine_tp2_splits_prompts_over_replicas_and_completes(tmp_path):
    rows = train_at_engine_tp2(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    # Both ranks of the engine group sent the same prompts (else the SPMD engine hangs or mixes them up), and
    # its answers' log-probs are the actor's.
    assert all(r["rollout/generated_samples"] > 0 and r["mismatch/abs_logp_diff_max"] < 1e-4 for r in rows)


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
    run_torchrun(
        REPO / "dapo_mcore/cli.py",
        2,
        "train",
        str(REPO / "examples/smoke_cpu.yaml"),
        "rollout.engine=vllm",
        "rollout.engine_tp_size=2",
        "trainer.steps=2",
        "rollout.prompts_per_step=4",
        "rollout.gen_prompts_per_round=4",
        "trainer.mini_batch_size=16",
        "trainer.micro_batch_size=16",
        "checkpoint.save_interval=0",
        "logging.wandb.mode=disabled",
        "logging.plot=false",
        "logging.progress=false",
        f"logging.run_dir={run_dir}",
        *overrides,
        timeout=timeout,
    )
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
