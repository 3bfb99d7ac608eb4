"""A mixture-of-experts actor (tiny Qwen3-MoE: 4 experts, top-2, layer 1 dense) gives the same loss, log-probs,
gradients and optimizer step at every expert layout: expert parallel (EP) against experts on every rank, EP
with tensor parallelism, expert TP apart from TP, and pipeline stages holding sparse and dense layers.

Compared at the same data-parallel size: Megatron's load-balancing loss (on here, at Qwen3-MoE's 0.001) is
computed per micro-batch, so a layout that splits the batch otherwise would change it. The layouts train
with the distributed optimizer and are compared by the weights after one step (Adam with eps=1: the update
is about the clipped gradient, so it checks the gradients and their norm over the expert groups); the
gradients themselves are compared without it (its reduce-scatter leaves each rank the reduced gradient of
its own shard only). Tolerances as in test_actor_parallel.py (fp32 on the CPU).
"""

from pathlib import Path

import pytest
import torch

from tests.dist.test_actor_parallel import GRAD_ATOL, LOGPROB_ATOL, LOSS_RTOL, Layouts, assert_same, prefetch
from tests.helpers import save_tiny_model

pytestmark = pytest.mark.dist

GRADS = {"moe_aux_loss": 0.001}
STEP = {**GRADS, "optimizer_step": True, "dist_opt": True}
# Sequence parallelism splits each row over the TP ranks, and Megatron weighs each rank's share of the
# load-balancing loss by its own count of non-padding tokens: with padding in the rows the ranks' shares
# differ, so the aux loss is not layout-invariant there (docs/moe.md); those layouts are compared without it.
# They replay engine routing (random experts, a third of the tokens left to the router): each TP rank's
# router must take its own slice of the sequence.
SP_STEP = {**STEP, "moe_aux_loss": 0.0, "routing_replay": True}
RUNS = [  # (processes, layout): the first of each data-parallel size is the reference
    (1, STEP),
    (2, {**STEP, "pp": 2}),
    (1, SP_STEP),
    (2, {**SP_STEP, "ep": 2}),
    # MoE with TP trains with sequence parallelism (Megatron's rule); expert TP 2 (= TP): gloo cannot
    # all-gather the all-to-all dispatcher's uneven splits (NCCL can), the all-gather dispatcher runs here
    (2, {**SP_STEP, "tp": 2, "sp": True, "moe_dispatcher": "allgather"}),
    (2, {**SP_STEP, "tp": 2, "etp": 1, "sp": True}),  # expert TP apart from TP at EP=1
    (4, {**SP_STEP, "tp": 2, "ep": 2, "sp": True, "moe_dispatcher": "allgather"}),
]


# Varied lengths under a 64-token budget: DP rank 0's share packs into 3 micro-batches, rank 1's into 4.
BUDGET = {**GRADS, "varied_samples": True, "max_tokens": 64}
# EP 2 under that budget, padded rows then packed ones, without and with full recompute (the 30B-A3B recipe's)
BOTH_PATHS = {**BUDGET, "ep": 2, "packing": "off,mask"}
# Context parallelism (docs/design/context_parallel.md section 9 step 6): EP 2 x CP 2 on 4 ranks against CP 1 at
# the same DP 2. Routing replay on, the aux loss off (the plan's first check); then the aux loss on, rows without
# padding (every sample 16 tokens): Megatron reduces the expert counts over TP x CP and weighs each CP rank's
# share by its own tokens, and the aux loss's gradient came out CP 1's with no compensation (unlike SP's 1/TP,
# mcore/provider.py _moe_kwargs): measured at coefficient 0.1, ratio 1.000000, gradients within 4e-8, with
# padded rows too (the CP ranks' shares then hold unequal real tokens), so the padded rows are compared as well.
CP_REPLAY = {"moe_aux_loss": 0.0, "routing_replay": True}
CP_AUX = {**GRADS, "equal_samples": True}
CP_RUNS = [(2, CP_REPLAY), (4, {**CP_REPLAY, "ep": 2, "cp": 2}), (2, CP_AUX), (4, {**CP_AUX, "ep": 2, "cp": 2}),
           (4, {**GRADS, "ep": 2, "cp": 2})]  # fmt: skip


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Layouts:
    root = tmp_path_factory.mktemp("moe")
    layouts = Layouts(save_tiny_model(root / "hf", "qwen3_moe", layers=4), root / "runs")
    grads = [
        (layouts, 2, GRADS),
        (layouts, 2, {**GRADS, "ep": 2}),
        (layouts, 2, BUDGET),
        (layouts, 2, {**BUDGET, "ep": 2}),
        (layouts, 2, BOTH_PATHS),
        (layouts, 2, {**BOTH_PATHS, "recompute": "full"}),
    ]
    prefetch([(layouts, nproc, layout) for nproc, layout in RUNS + CP_RUNS] + grads)
    return layouts


def _same_step(result: dict, reference: dict) -> None:
    run = "token-mean/4/0"
    assert result["runs"][run]["loss"] == pytest.approx(reference["runs"][run]["loss"], rel=LOSS_RTOL)
    for got, want in zip(result["logprobs"], reference["logprobs"]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=LOGPROB_ATOL)
    assert set(result["stepped"]) == set(reference["stepped"])
    for name, weight in reference["stepped"].items():
        torch.testing.assert_close(result["stepped"][name], weight, rtol=0, atol=GRAD_ATOL, msg=name)


def test_the_model_has_experts_and_they_learn(moe):
    """Not vacuous: every expert of the sparse layers gets a gradient, and the dense layer has none."""
    grads = moe.run(2, **GRADS)["runs"]["token-mean/4/0"]["grads"]
    expert_grads = {n: g for n, g in grads.items() if ".mlp.experts." in n}
    assert len(expert_grads) == 3 * 4 * 3  # 3 sparse layers x 4 experts x gate, up, down
    assert not any(n.startswith("model.layers.1.mlp.experts.") for n in grads)
    assert "model.layers.1.mlp.gate_proj.weight" in grads
    assert all(g.abs().sum() > 0 for g in expert_grads.values())
    assert grads["model.layers.0.mlp.gate.weight"].abs().sum() > 0  # the router learns too


def test_expert_parallel_gives_the_gradients_of_experts_on_every_rank(moe):
    assert_same(moe.run(2, **GRADS, ep=2), moe.run(2, **GRADS))


def test_expert_parallel_with_a_token_budget_runs_as_many_micro_batches_on_every_rank(moe):
    """Under a token budget each DP rank packs its own share, into 3 and 4 micro-batches here. Expert parallelism
    runs an all-to-all per micro-batch across the DP ranks: the rank with one more waited in one that no partner
    joined (the 30B-A3B recipe hung at its first step). Every rank now runs the largest count, and the gradients
    are those of the experts on every rank."""
    run = "token-mean/4/64"
    assert_same(moe.run(2, **BUDGET, ep=2), moe.run(2, **BUDGET), run=run, reference_run=run)


def test_full_recompute_of_a_padding_micro_batch_gives_the_gradients_of_no_recompute(moe):
    """The short DP rank's extra micro-batch is padding only, whose routers' losses would divide by its 0 tokens.
    They were turned off by changing the shared config around its forward; full recompute runs the layers again
    inside backward, after the change was undone: 0 / 0, NaN in most gradients of the 30B-A3B recipe's first
    step. The flag now travels with the micro-batch into its recompute. Padded rows and packed rows alike."""
    recomputed, reference = moe.run(2, **BOTH_PATHS, recompute="full"), moe.run(2, **BOTH_PATHS)
    for run in ("token-mean/4/64", "token-mean/4/64/mask"):
        assert all(torch.isfinite(g).all() for g in recomputed["runs"][run]["grads"].values()), run
        assert_same(recomputed, reference, run=run, reference_run=run)


def test_expert_parallel_with_the_distributed_optimizer(moe):
    """DP 2 against DP 1, so without the aux loss (per micro-batch); EP with it: the gradients above."""
    _same_step(moe.run(2, **SP_STEP, ep=2), moe.run(1, **SP_STEP))


def test_tensor_and_expert_parallel_together(moe):
    """TP 2 x EP 2 with expert TP 2: each expert gathered over expert TP, then sent over EP (the all-to-all
    dispatcher runs at EP 2 above; at expert TP 2 gloo needs the all-gather one)."""
    reference = moe.run(1, **SP_STEP)  # DP 2 against DP 1: the same gradient without the aux loss
    _same_step(moe.run(4, **SP_STEP, tp=2, ep=2, sp=True, moe_dispatcher="allgather"), reference)


def test_tensor_parallel_with_sequence_parallel_experts(moe):
    _same_step(moe.run(2, **SP_STEP, tp=2, sp=True, moe_dispatcher="allgather"), moe.run(1, **SP_STEP))


def test_pipeline_stages_with_sparse_and_dense_layers(moe):
    _same_step(moe.run(2, **STEP, pp=2), moe.run(1, **STEP))


def test_expert_tensor_parallel_apart_from_tensor_parallel(moe):
    """TP=2 x expert TP=1 at EP=1: the two TP ranks share every expert, which sums its gradient over them."""
    _same_step(moe.run(2, **SP_STEP, tp=2, etp=1, sp=True), moe.run(1, **SP_STEP))


def test_expert_names_are_global_at_every_layout(moe, tmp_path: Path):
    """The exported weights (what the engines receive) name every expert once, whichever rank holds it."""
    reference = moe.run(1, **STEP)["weights"]
    for nproc, layout in RUNS[1:]:
        weights = moe.run(nproc, **layout)["weights"]
        assert set(weights) == set(reference), layout
        for name, tensor in reference.items():
            assert torch.equal(weights[name], tensor), (layout, name)


def _same_router_metrics(result: dict, reference: dict, run: str = "token-mean/4/0") -> None:
    got, want = result["runs"][run]["router"], reference["runs"][run]["router"]
    assert set(got) == set(want) and want
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-6), name


def test_expert_and_context_parallel_give_the_gradients_of_cp_1(moe):
    """EP 2 x CP 2: each sequence split over 2 CP ranks, the engine's routing split with it (each CP rank's
    routers replay its columns), the experts over EP; the router metrics summed over CP too."""
    result, reference = moe.run(4, **CP_REPLAY, ep=2, cp=2), moe.run(2, **CP_REPLAY)
    assert_same(result, reference)
    _same_router_metrics(result, reference)


def test_the_load_balancing_loss_under_context_parallel_is_that_of_cp_1_without_padding(moe):
    result, reference = moe.run(4, **CP_AUX, ep=2, cp=2), moe.run(2, **CP_AUX)
    assert_same(result, reference)
    _same_router_metrics(result, reference)
    assert "router/aux_loss" in reference["runs"]["token-mean/4/0"]["router"]


def test_the_load_balancing_loss_under_context_parallel_with_padding(moe):
    result, reference = moe.run(4, **GRADS, ep=2, cp=2), moe.run(2, **GRADS)
    assert_same(result, reference)
    _same_router_metrics(result, reference)
