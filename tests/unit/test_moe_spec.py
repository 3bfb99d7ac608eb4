"""Qwen3-MoE configs into ModelSpec, the layouts a MoE model can and cannot take, and its HF <-> Megatron names."""

import pytest
import torch

from dapo_mcore.checkpoint.convert import LlamaFamilyMap
from dapo_mcore.config.model_spec import read_model_spec
from dapo_mcore.mcore.provider import check_model_layout, check_moe_training_layout
from dapo_mcore.mcore.sharding import _global_expert_name, tp_split_of
from dapo_mcore.parallel.state import check_layout
from dapo_mcore.utils.errors import ConfigError, LayoutError
from tests.helpers import tiny_hf_config

pytestmark = pytest.mark.unit


def moe_config(**changes) -> dict:
    return {**tiny_hf_config("qwen3_moe", layers=4).to_dict(), **changes}


def test_qwen3_moe_config_gives_experts_router_and_sparse_layers():
    spec = read_model_spec(moe_config())
    assert (spec.num_experts, spec.moe_topk, spec.moe_ffn_hidden_size) == (4, 2, 32)
    assert spec.moe_norm_topk_prob and spec.qk_norm and not spec.qkv_bias
    assert spec.moe_layers == (True, False, True, True)  # mlp_only_layers=[1]
    assert spec.router_aux_loss_coef == pytest.approx(0.001)
    every_other = read_model_spec(moe_config(mlp_only_layers=[], decoder_sparse_step=2))
    assert every_other.moe_layers == (False, True, False, True)  # transformers: (i + 1) % step == 0
    assert not read_model_spec(tiny_hf_config("qwen3").to_dict()).is_moe


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model_type": "qwen2_moe"}, "shared expert"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
        ({"mlp_only_layers": [7]}, "mlp_only_layers=[7]"),
        ({"num_experts": 0, "num_local_experts": 0}, "no num_experts"),
    ],
)
def test_a_moe_config_it_cannot_honour_is_one_line(changes, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_model_spec(moe_config(**changes))


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ({"ep": 3}, "4 experts do not split over parallel.expert_model_parallel_size=3"),
        ({"tp": 1, "etp": 3}, "expert FFN width"),
    ],
)
def test_a_layout_the_experts_cannot_take_names_what_does_not_divide(layout, message):
    spec = read_model_spec(moe_config())
    with pytest.raises(LayoutError, match=message):
        check_model_layout(spec, layout.get("tp", 1), 1, 1, layout.get("ep", 1), layout.get("etp", 0))


def test_expert_parallelism_on_a_dense_model_and_an_expert_layout_beyond_the_world_are_refused():
    with pytest.raises(LayoutError, match="has no experts"):
        check_model_layout(read_model_spec(tiny_hf_config("qwen3").to_dict()), 1, 1, 1, ep=2)
    with pytest.raises(LayoutError, match="EP=4 x expert TP=1 x PP=1 = 4 ranks does not divide the world size 2"):
        check_layout(2, 1, 1, ep=4)
    assert check_layout(4, 2, 1, ep=2, etp=1) == 2  # DP of the dense layers


def test_moe_with_tensor_parallelism_needs_sequence_parallelism():
    spec = read_model_spec(moe_config())
    with pytest.raises(ConfigError, match="sequence_parallel=true"):
        check_moe_training_layout(spec, 2, sequence_parallel=False)
    check_moe_training_layout(spec, 2, sequence_parallel=True)


def test_every_expert_name_maps_to_hf_and_back():
    spec = read_model_spec(moe_config())
    family = LlamaFamilyMap(spec)
    names = family.mcore_names()
    experts = [n for n in names if ".mlp.experts." in n]
    assert len(experts) == 3 * 4 * 2  # sparse layers x experts x (fc1, fc2)
    assert "decoder.layers.1.mlp.linear_fc1.weight" in names and "decoder.layers.0.mlp.router.weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.weight" not in names  # layer 0 is sparse
    fc1 = "decoder.layers.2.mlp.experts.local_experts.3.linear_fc1.weight"
    assert family.hf_sources(fc1) == [
        "model.layers.2.mlp.experts.3.gate_proj.weight",
        "model.layers.2.mlp.experts.3.up_proj.weight",
    ]
    gate, up = torch.randn(32, 64), torch.randn(32, 64)
    fused = family.hf_to_mcore(fc1, [gate, up])
    (n1, t1), (n2, t2) = family.mcore_to_hf(fc1, fused)
    assert (n1, n2) == tuple(family.hf_sources(fc1)) and torch.equal(t1, gate) and torch.equal(t2, up)
    te = LlamaFamilyMap(spec, te_layer_names=True)
    assert te.hf_sources("decoder.layers.2.mlp.experts.linear_fc2.weight3") == [
        "model.layers.2.mlp.experts.3.down_proj.weight"
    ]
    with pytest.raises(KeyError):
        family.hf_sources("decoder.layers.1.mlp.router.weight")  # layer 1 is dense


class _Layer(torch.nn.Module):
    def __init__(self, local_expert_indices):
        super().__init__()
        self.mlp = torch.nn.Module()
        self.mlp.local_expert_indices = local_expert_indices


def test_local_expert_names_become_global_on_each_expert_parallel_rank():
    second_rank = _Layer([2, 3])
    assert (
        _global_expert_name("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", second_rank)
        == "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"
    )
    assert (
        _global_expert_name("decoder.layers.0.mlp.experts.linear_fc2.weight0", second_rank)
        == "decoder.layers.0.mlp.experts.linear_fc2.weight2"
    )
    router = "decoder.layers.0.mlp.router.weight"
    assert _global_expert_name(router, second_rank) == router
    expert_fc1 = torch.nn.Parameter(torch.zeros(4, 4))
    expert_fc1.tensor_model_parallel, expert_fc1.partition_dim = True, 0
    split = tp_split_of("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight", expert_fc1)
    assert split.swiglu and split.expert and split.dim == 0


def test_the_hf_engine_takes_per_expert_weights_into_transformers_fused_experts():
    from transformers import AutoModelForCausalLM

    from dapo_mcore.rollout.model_info import checkpoint_named_views

    model = AutoModelForCausalLM.from_config(tiny_hf_config("qwen3_moe", layers=4))
    views = checkpoint_named_views(model)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in views and "model.layers.1.mlp.up_proj.weight" in views
    views["model.layers.0.mlp.experts.3.up_proj.weight"].copy_(torch.ones(32, 64))
    fused = dict(model.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(fused[3, 32:], torch.ones(32, 64))  # gate rows first, as transformers' forward chunks
    assert not torch.equal(fused[3, :32], torch.ones(32, 64))
