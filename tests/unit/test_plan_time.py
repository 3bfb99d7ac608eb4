"""The step-time estimate of `dapo-mcore plan` (dapo_mcore/plan_time.py): its arithmetic on round numbers, and
the figures it prints for a recipe."""

import subprocess
import sys

import pytest

from dapo_mcore.plan_time import (
    ADAM_BYTES_PER_PARAM,
    BF16_PEAK,
    CPU_ADAM_S_PER_PARAM,
    HBM_EFFICIENCY,
    HBM_H100,
    HBM_H200,
    HOST_DRAM_BW,
    StepShape,
    estimate,
)
from tests.unit.test_plan import QWEN_7B, REPO

SHAPE = StepShape(
    answers=1000, mean_prompt=100, mean_len=1000, keep_rate=0.5, replicas=4, kv_tokens=55_000,
    engine_weight_bytes=10e9, kv_bytes_per_token=1e5, active_params=1e9, layers=10, attention_width=1000,
    gpus=4, gpu_gb=80, mfu=0.5,
)  # fmt: skip


def test_generation_is_decode_bound_on_the_weights_and_kv_a_replica_reads():
    step = estimate(SHAPE)
    assert step.per_replica == 500  # 1000 kept / 0.5 / 4 replicas
    assert step.at_once == 50  # 55,000 KV tokens / (100 + 1000)
    read = 10e9 + 50 * (100 + 500) * 1e5  # weights + the sequences' mean context of KV
    assert step.decode_step_s == pytest.approx(read / (HBM_H100 * HBM_EFFICIENCY))
    assert step.generation_s == pytest.approx(500 * 1000 / 50 * step.decode_step_s)
    assert estimate(StepShape(**{**SHAPE.__dict__, "gpu_gb": 141})).decode_step_s == pytest.approx(
        read / (HBM_H200 * HBM_EFFICIENCY)
    )


def test_training_is_the_kept_tokens_flops_at_the_stated_mfu():
    step = estimate(SHAPE)
    per_token = 8 * 1e9 + 16 * 10 * 1000 * 600  # update + old log-probs, causal attention over the mean context
    assert step.training_s == pytest.approx(1000 * 1100 * per_token / (4 * BF16_PEAK * 0.5))
    assert step.total_s == step.generation_s + step.training_s


def test_the_plan_prints_the_estimate_for_a_recipe_at_the_mean_length_asked():
    def line(*extra):
        out = subprocess.run(
            [sys.executable, "-m", "dapo_mcore.cli", "plan", "examples/dapo_qwen2.5_7b_h100.yaml", "--gpus", "8",
             "--model-config", str(QWEN_7B), *extra],
            cwd=REPO, capture_output=True, text=True, check=False,
        ).stdout  # fmt: skip
        return next(text for text in out.splitlines() if text.startswith("step time"))

    late, early = line(), line("--mean-len", "1000")
    assert "mean answer 8,192 tokens" in late and "about 1.6 h a step" in late
    assert "mean answer 1,000 tokens" in early and "about 8 min a step" in early


def test_cpu_adam_is_the_updates_over_the_host_params_at_the_threads_floored_by_host_bandwidth():
    """optimizer.cpu_offload: one fused CPU AdamW step per update over a rank's host parameters; threads divide
    one thread's time until the node's ranks, stepping together, share out its memory bandwidth."""
    assert estimate(SHAPE).cpu_adam_s == 0.0  # nothing offloaded
    floor = ADAM_BYTES_PER_PARAM * 4 / HOST_DRAM_BW  # 4 GPUs: 4 ranks share the host's memory
    for threads in (1, 2, 64):
        step = estimate(StepShape(**{**SHAPE.__dict__, "updates": 16, "host_params": 1e9, "cpu_threads": threads}))
        per_param = max(CPU_ADAM_S_PER_PARAM / threads, floor)
        assert step.cpu_adam_s == pytest.approx(16 * 1e9 * per_param)
        assert step.total_s == pytest.approx(step.generation_s + step.training_s + step.cpu_adam_s)
    assert per_param == floor


def test_the_plan_prints_the_cpu_adam_of_the_offloading_recipe_on_its_own_line():
    """The 30B-A3B recipe (optimizer.cpu_offload, 8 GPUs): 512 x 16 answers / mini-batches of 512 = 16 updates,
    over a rank's optimizer shard, 1.54B dense params / DP 8 + its 16 experts' 3.62B = 3.82B."""

    def lines(*extra):
        out = subprocess.run(
            [sys.executable, "-m", "dapo_mcore.cli", "plan", "examples/dapo_qwen3_30b_a3b_h100.yaml", "--gpus", "8",
             "--model-config", str(REPO / "examples/models/Qwen3-30B-A3B"), *extra],
            cwd=REPO, capture_output=True, text=True, check=False,
        ).stdout.splitlines()  # fmt: skip
        return next(t for t in lines_of(out, "step time")), next(t for t in lines_of(out, "CPU Adam a step"))

    step, adam = lines("--cpu-threads", "8")
    per_param = max(CPU_ADAM_S_PER_PARAM / 8, ADAM_BYTES_PER_PARAM * 8 / HOST_DRAM_BW)
    seconds = 16 * 3.82e9 * per_param
    assert f"CPU Adam {seconds:.0f} s:" in step
    assert adam.startswith(
        f"CPU Adam a step (optimizer.cpu_offload), estimated: 16 updates x 3.82B host params a "
        f"rank x {per_param * 1e9:.2f} ns a param = {seconds:.0f} s; fused AdamW at 8 threads"
    )
    assert "fused AdamW at 1 thread " in lines("--cpu-threads", "1")[1]
    plain = subprocess.run(
        [sys.executable, "-m", "dapo_mcore.cli", "plan", "examples/dapo_qwen2.5_7b_h100.yaml", "--gpus", "8",
         "--model-config", str(QWEN_7B)],
        cwd=REPO, capture_output=True, text=True, check=False,
    ).stdout  # fmt: skip
    assert "CPU Adam" not in plain  # no optimizer.cpu_offload, no line


def lines_of(out: list[str], start: str) -> list[str]:
    return [text for text in out if text.startswith(start)]
