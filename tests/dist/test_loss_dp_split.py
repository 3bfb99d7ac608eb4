"""Property over a real 2-rank gloo data-parallel split: for every aggregation mode, all-reduced numerator
gradients over all-reduced denominators equal the whole mini-batch's gradient (float64, 1e-10)."""

from pathlib import Path

from tests.conftest import run_torchrun


def test_gradient_is_independent_of_a_two_rank_data_parallel_split():
    run_torchrun(Path(__file__).parent / "workers" / "loss_dp_split.py", 2, timeout=300)
