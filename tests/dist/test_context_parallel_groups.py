"""Context parallelism, step 1 (docs/design/context_parallel.md section 9): init_parallel(cp=) builds Megatron's CP
groups on 4 gloo ranks. Megatron-Core's order tp-cp-ep-dp-pp numbers a rank tp + TP * (cp + CP * dp), so a
rank's CP peers are TP ranks apart: at TP 2 x CP 2 the CP groups are [0, 2] and [1, 3] (and the TP groups [0, 1],
[2, 3]); at TP 1 x CP 2 x DP 2 they are [0, 1] and [2, 3], the DP groups [0, 2] and [1, 3]. The CP ranks of one
sequence share dp_rank (they are sent the same samples); gradients and token counts sum over dp_cp (DP x CP)."""

import json
from pathlib import Path

import pytest

from tests.conftest import run_torchrun

pytestmark = pytest.mark.dist

WORLD = 4


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("cp_groups")
    run_torchrun(Path(__file__).parent / "workers" / "cp_groups.py", WORLD, str(out), timeout=120)
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def test_cp_peers_are_tp_ranks_apart_at_tp2_cp2(seen):
    ranks = [rank["tp2_cp2"] for rank in seen]
    assert [r["groups"]["cp"] for r in ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["groups"]["tp"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["ranks"]["cp"] for r in ranks] == [0, 0, 1, 1]
    assert [r["ranks"]["tp"] for r in ranks] == [0, 1, 0, 1]
    # DP (without CP) is 1: world / (TP x PP x CP); dp_cp joins the CP peers
    assert all(r["sizes"] == {"cp": 2, "dp": 1, "dp_cp": 2} for r in ranks)
    assert [r["groups"]["dp_cp"] for r in ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["groups"]["dp"] for r in ranks] == [[0], [1], [2], [3]]
    assert all(r["ranks"]["dp"] == 0 for r in ranks)
    assert ranks[0]["describe"].startswith("world=4 = TP 2 x CP 2 x PP 1 x DP 1 ")
    assert ranks[0]["layout"] == {"tp": 2, "pp": 1, "vpp": 1, "dp": 1, "cp": 2}


def test_cp_peers_share_their_dp_rank_and_dp_cp_spans_both_at_cp2_dp2(seen):
    ranks = [rank["tp1_cp2_dp2"] for rank in seen]
    assert [r["groups"]["cp"] for r in ranks] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["groups"]["dp"] for r in ranks] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(r["groups"]["dp_cp"] == [0, 1, 2, 3] for r in ranks)
    assert all(r["sizes"] == {"cp": 2, "dp": 2, "dp_cp": 4} for r in ranks)
    assert [r["ranks"]["cp"] for r in ranks] == [0, 1, 0, 1]
    assert [r["ranks"]["dp"] for r in ranks] == [0, 0, 1, 1]
    for r in ranks:  # every CP peer of a rank has its dp_rank
        assert {ranks[peer]["ranks"]["dp"] for peer in r["groups"]["cp"]} == {r["ranks"]["dp"]}
    assert ranks[0]["describe"].startswith("world=4 = TP 1 x CP 2 x PP 1 x DP 2 ")
