"""Context parallelism, step 1 (docs/design/context_parallel.md section 9): the layout arithmetic with CP, the
config key and its documentation, the save's layout record, and its validation; dense and mixture-of-experts
models train at CP > 1 (tests/dist/test_actor_parallel.py, tests/dist/test_moe_parallel.py,
tests/e2e/test_train_cli.py)."""

from pathlib import Path

import pytest
import torch

from dapo_mcore.checkpoint.run_checkpoint import layout_for
from dapo_mcore.cli import main
from dapo_mcore.config import load_config, validate
from dapo_mcore.config.key_docs import key_descriptions
from dapo_mcore.parallel.state import ParallelContext, check_layout
from dapo_mcore.utils.errors import ConfigError, LayoutError

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
MOE_DIR = REPO / "examples/models/tiny-arith-moe"


@pytest.mark.parametrize(
    "world, layout, dp",
    [
        (4, {"tp": 2, "pp": 1, "cp": 2}, 1),
        (8, {"tp": 2, "pp": 1, "cp": 2}, 2),
        (16, {"tp": 2, "pp": 2, "cp": 2}, 2),
        (8, {"tp": 1, "pp": 2, "vpp": 2, "cp": 4}, 1),
        (32, {"tp": 8, "pp": 1, "cp": 2}, 2),
        (4, {"tp": 2, "pp": 1}, 2),  # CP 1 as before
        # experts ignore CP (Megatron's expert rank generator has no CP axis): EP folds over TP x CP x DP
        (4, {"tp": 2, "pp": 1, "cp": 2, "ep": 4, "etp": 1}, 1),
        (8, {"tp": 1, "pp": 1, "cp": 2, "ep": 8}, 4),
    ],
)
def test_data_parallel_size_is_the_world_over_tp_pp_and_cp(world, layout, dp):
    assert check_layout(world, **layout) == dp


def test_a_layout_whose_tp_pp_cp_does_not_divide_the_world_names_cp():
    with pytest.raises(LayoutError) as err:
        check_layout(6, 2, 1, cp=2)
    assert str(err.value) == (
        "parallel layout TP=2 x PP=1 x CP=2 = 4 ranks does not divide the world size 6; launch a multiple of 4 "
        "processes or change parallel.tensor_model_parallel_size / parallel.pipeline_model_parallel_size / "
        "parallel.context_parallel_size"
    )
    with pytest.raises(LayoutError, match="TP=1 x PP=1 x CP=2 = 2 ranks does not divide the world size 1"):
        check_layout(1, 1, 1, cp=2)
    with pytest.raises(LayoutError, match=r"parallel.context_parallel_size must be >= 1, got 0"):
        check_layout(4, 1, 1, cp=0)


def test_the_expert_layout_rule_is_unchanged_by_cp():
    """world % (EP x expert TP x PP) as at CP 1: TP 2 x CP 2 on 4 ranks fits, EP 8 there does not."""
    with pytest.raises(
        LayoutError, match="expert layout EP=8 x expert TP=1 x PP=1 = 8 ranks does not divide the world size 4"
    ):
        check_layout(4, 2, 1, cp=2, ep=8, etp=1)


def test_the_layout_record_names_cp_only_above_one():
    assert layout_for(2, 1, 1, 1, cp=2) == {"tp": 2, "pp": 1, "vpp": 1, "dp": 1, "cp": 2}
    assert layout_for(2, 1, 1, 2) == {"tp": 2, "pp": 1, "vpp": 1, "dp": 2}  # a save without cp reads as CP 1
    assert layout_for(1, 1, 1, 1, ep=2, cp=2) == {"tp": 1, "pp": 1, "vpp": 1, "dp": 1, "ep": 2, "etp": 1, "cp": 2}


def test_describe_names_cp_only_above_one():
    def ctx(cp: int, dp: int) -> ParallelContext:
        return ParallelContext(
            torch.device("cpu"), 0, 2 * cp * dp, 0, 2, 0, 1, 1, 0, dp, None, [0], etp_size=2, cp_size=cp
        )

    assert ctx(2, 1).describe() == "world=4 = TP 2 x CP 2 x PP 1 x DP 1 on cpu (gloo)"
    assert ctx(1, 2).describe() == "world=4 = TP 2 x PP 1 x DP 2 on cpu (gloo)"


def test_the_cp_key_is_documented_and_shown_by_keys(capsys):
    assert "DP = world / (TP x PP x CP)" in key_descriptions()["parallel.context_parallel_size"]
    assert main(["keys", "parallel"]) == 0
    out = capsys.readouterr().out
    assert "parallel.context_parallel_size = 1\n    Context parallelism (CP) of the actor" in out
    assert "docs/design/context_parallel.md" in out


@pytest.mark.parametrize(
    "value, moe, message",
    [("0", False, "parallel.context_parallel_size must be >= 1, got 0"), ("2", True, None), ("2", False, None)],
)
def test_cp_is_validated_and_above_one_accepted_for_dense_and_moe_models(value, moe, message, tiny_llama_dir):
    cfg = load_config(
        REPO / "examples/smoke_cpu.yaml",
        [f"model.hf_path={MOE_DIR if moe else tiny_llama_dir}", f"parallel.context_parallel_size={value}"],
    )
    if message is None:
        validate(cfg)
        return
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value) == message
