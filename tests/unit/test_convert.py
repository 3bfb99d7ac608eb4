import pytest
import torch

from dapo_mcore.checkpoint.convert import LlamaFamilyMap
from dapo_mcore.config.model_spec import read_model_spec
from dapo_mcore.mcore.sharding import TPSplit, shard_of
from tests.helpers import tiny_hf_config


def hf_state(family, tie=False):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_hf_config(family, tie)).state_dict(), tiny_hf_config(family, tie)


@pytest.mark.parametrize("family, tie", [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)])
def test_hf_to_mcore_to_hf_is_the_identity(family, tie):
    state, config = hf_state(family, tie)
    fmap = LlamaFamilyMap(read_model_spec(config.to_dict()))
    back = {}
    for name in fmap.mcore_names():
        full = fmap.hf_to_mcore(name, [state[n] for n in fmap.hf_sources(name)])
        back.update(fmap.mcore_to_hf(name, full))
    expected = {k: v for k, v in state.items() if not (tie and k == "lm_head.weight")}
    assert set(back) == set(expected)
    for k, v in expected.items():
        assert torch.equal(back[k], v), k


def test_fused_qkv_is_laid_out_per_query_group():
    state, config = hf_state("llama")
    fmap = LlamaFamilyMap(read_model_spec(config.to_dict()))
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    fused = fmap.hf_to_mcore(name, [state[n] for n in fmap.hf_sources(name)])
    q, k = state["model.layers.0.self_attn.q_proj.weight"], state["model.layers.0.self_attn.k_proj.weight"]
    d = 16  # head_dim; 4 heads in 2 groups: [q0 q1 k0 v0 | q2 q3 k1 v1]
    assert torch.equal(fused[: 2 * d], q[: 2 * d]) and torch.equal(fused[2 * d : 3 * d], k[:d])
    assert torch.equal(fused[4 * d : 6 * d], q[2 * d :])


def test_swiglu_shards_hold_their_slice_of_gate_then_up():
    gate, up = torch.arange(8.0).reshape(4, 2), 100 + torch.arange(8.0).reshape(4, 2)
    shard = shard_of(torch.cat([gate, up]), TPSplit(dim=0, swiglu=True), tp_rank=1, tp_size=2, padded_vocab=0)
    assert torch.equal(shard, torch.cat([gate[2:], up[2:]]))


def test_vocab_rows_are_padded_before_splitting():
    emb = torch.ones(5, 3)
    shard = shard_of(emb, TPSplit(dim=0, vocab=True), tp_rank=1, tp_size=2, padded_vocab=8)
    assert shard.shape == (4, 3) and shard[1:].abs().sum() == 0 and shard[0].sum() == 3


def test_unsupported_hf_config_fields_are_named():
    from dapo_mcore.utils.errors import ConfigError

    config = tiny_hf_config("llama").to_dict()
    for key, value, message in (
        ("hidden_act", "gelu", "hidden_act='gelu'"),
        ("model_type", "gpt2", "model_type='gpt2'"),
        ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling"),
    ):
        with pytest.raises(ConfigError, match=message):
            read_model_spec({**config, key: value})


def test_llama3_rope_scaling_is_read_and_unsupported_parameters_are_named():
    from dapo_mcore.utils.errors import ConfigError
    from tests.helpers import LLAMA3_ROPE

    config = tiny_hf_config("llama").to_dict()
    assert read_model_spec({**config, "rope_scaling": LLAMA3_ROPE}).rope_scaling_factor == 8.0
    assert read_model_spec(config).rope_scaling_factor is None
    with pytest.raises(
        ConfigError,
        match=r"rope_scaling.low_freq_factor=2.0: Megatron-Core's llama3 RoPE scaling "
        r"fixes it at 1.0",
    ):
        read_model_spec({**config, "rope_scaling": {**LLAMA3_ROPE, "low_freq_factor": 2.0}})
