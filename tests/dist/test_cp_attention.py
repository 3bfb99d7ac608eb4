"""Context parallelism on the CPU (2 gloo ranks, CP 2): the CPU twin of CP attention gives each rank the CP-1
output rows and dQ, dK, dV at its columns (fp32, 1e-6), and a tiny GPTModel of the project's local spec gives the
CP-1 logits at each rank's columns (1e-5) and, summed over the CP ranks, its weight gradients (1e-6), for rows of one
sample (bshd, Megatron's row split) and packed rows (THD against the block-mask path): Megatron's own RoPE slicing
per CP rank agrees with the layouts (docs/design/context_parallel.md sections 3 and 4)."""

from pathlib import Path

from tests.conftest import run_torchrun


def test_cp_2_attention_and_model_equal_cp_1_at_each_ranks_columns(tiny_llama_dir):
    proc = run_torchrun(Path(__file__).parent / "workers" / "cp_attention.py", 2, str(tiny_llama_dir), timeout=300)
    assert proc.stdout.count("== CP 1 at its columns") == 2 * 4, proc.stdout
