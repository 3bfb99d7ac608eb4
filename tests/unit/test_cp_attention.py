"""The CPU twin of context-parallel attention at CP 1 (one process): Megatron's DotProductAttention on causal bshd
rows and the block-mask path on packed rows, outputs and dQ, dK, dV to 1e-6 (fp32); its column layouts; the local
spec's substitution only at CP > 1; the CPU replacement of Megatron's RoPE slice per CP rank.
(The CP-2 equalities run on 2 gloo ranks: tests/dist/test_cp_attention.py.)"""

import pytest
import torch

from dapo_mcore.data.batching import block_causal_mask
from dapo_mcore.data.batching import row_cp_columns as row_columns
from dapo_mcore.data.batching import thd_cp_columns as thd_columns
from dapo_mcore.mcore.cp_attention import CPAllGatherAttention
from dapo_mcore.parallel import destroy_parallel, init_parallel
from tests.unit.test_plan import FakeGroup

HEADS, GROUPS, HEAD_DIM = 4, 2, 16  # grouped-query attention: 2 query heads per key/value group
ATOL = 1e-6


@pytest.fixture(scope="module")
def ctx():
    destroy_parallel()
    yield init_parallel(1, 1, "cpu")
    destroy_parallel()


def attention_config(cp: int = 1):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=HEAD_DIM,
        context_parallel_size=cp,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        masked_softmax_fusion=False,
        use_cpu_initialization=True,
    )


def core_attentions(ctx):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    kwargs = dict(
        config=attention_config(),
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        cp_comm_type=None,
        softmax_scale=None,
        pg_collection=ctx.pg,
    )
    return CPAllGatherAttention(**kwargs), DotProductAttention(**kwargs)


def qkv(s: int, b: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(s, b, HEADS, HEAD_DIM), (s, b, GROUPS, HEAD_DIM), (s, b, GROUPS, HEAD_DIM)]
    return [torch.randn(*shape, generator=g).requires_grad_() for shape in shapes]


def output_and_grads(attention, inputs, **kwargs) -> list[torch.Tensor]:
    out = attention(*inputs, **kwargs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    grads = torch.autograd.grad(out, inputs, upstream)
    return [out.detach(), *grads]


def assert_all_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for name, g, w in zip(("output", "dQ", "dK", "dV"), got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=ATOL, msg=name)


def test_twin_equals_dot_product_attention_on_causal_rows_outputs_and_gradients(ctx):
    twin, megatron = core_attentions(ctx)
    inputs = qkv(s=24, b=3)
    got = output_and_grads(twin, inputs, attention_mask=None)
    want = output_and_grads(megatron, inputs, attention_mask=None)
    assert got[0].shape == (24, 3, HEADS * HEAD_DIM)
    assert_all_close(got, want)


def test_twin_on_packed_thd_rows_equals_the_block_mask_path(ctx):
    from megatron.core.packed_seq_params import PackedSeqParams

    twin, megatron = core_attentions(ctx)
    lengths = [5, 9, 1, 7, 2]  # the last: a padding tail, a segment of its own
    segment_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]  # [1, T]
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths)
    )
    inputs = qkv(s=sum(lengths), b=1, seed=1)
    # THD: Attention hands the core attention [t, heads, d] (batch squeezed) and gets [t, heads * d] back
    squeezed = [x.detach().squeeze(1).requires_grad_() for x in inputs]
    got = output_and_grads(twin, squeezed, attention_mask=None, packed_seq_params=params)
    want = output_and_grads(megatron, inputs, attention_mask=block_causal_mask(segment_ids))
    assert got[0].shape == (sum(lengths), HEADS * HEAD_DIM)
    assert_all_close(got, [want[0].squeeze(1), *(w.squeeze(1) for w in want[1:])])


def test_twin_takes_an_explicit_block_mask_at_cp_1_as_dot_product_attention_does(ctx):
    twin, megatron = core_attentions(ctx)
    segment_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1]])
    mask = block_causal_mask(segment_ids)
    inputs = qkv(s=8, b=2, seed=2)
    assert_all_close(
        output_and_grads(twin, inputs, attention_mask=mask), output_and_grads(megatron, inputs, attention_mask=mask)
    )


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_row_columns_are_megatrons_chunks_r_and_2c_minus_1_minus_r_and_partition_the_row(cp):
    length = 8 * cp
    chunks = torch.arange(length).view(2 * cp, -1)
    columns = [row_columns(length, cp, r) for r in range(cp)]
    for r, cols in enumerate(columns):  # MC/utils.py get_batch_on_this_cp_rank's index_select
        assert cols.tolist() == chunks[[r, 2 * cp - 1 - r]].reshape(-1).tolist()
    assert sorted(torch.cat(columns).tolist()) == list(range(length))
    # equal causal work per rank: sum of (column + 1) over the rank's queries
    assert len({int((cols + 1).sum()) for cols in columns}) == 1


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_thd_columns_follow_the_partition_formula_per_sequence(cp):
    g = torch.Generator().manual_seed(cp)
    lengths = (torch.randint(1, 5, (6,), generator=g) * 2 * cp).tolist()
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0))
    columns = [thd_columns(cu, cp, r) for r in range(cp)]
    assert sorted(torch.cat(columns).tolist()) == list(range(int(cu[-1])))
    for r, cols in enumerate(columns):
        want, local_start = [], 0
        for start, length in zip(cu[:-1].tolist(), lengths):
            c = length // (2 * cp)
            for u in range(2 * c):  # TE's thd_partition_indices_kernel, docs/design/context_parallel.md section 4
                want.append(start + u + c * r if u < c else start + (u - c) + c * (2 * cp - 1 - r))
            local_start += 2 * c
        assert cols.tolist() == want


def test_columns_refuse_lengths_that_do_not_split_into_2c_chunks():
    with pytest.raises(ValueError, match="2 x CP = 4"):
        row_columns(6, 2, 0)
    with pytest.raises(ValueError, match="2 x CP = 4"):
        thd_columns(torch.tensor([0, 4, 10]), 2, 0)


@pytest.mark.parametrize("cp", [2, 4])
def test_cpu_rope_slice_keeps_the_positions_of_the_ranks_columns(cp):
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    from dapo_mcore.mcore.mcore_compat import cpu_rope_cp_slice

    cpu_rope_cp_slice()
    assert rotary_pos_embedding.get_pos_emb_on_this_cp_rank is rope_utils.get_pos_emb_on_this_cp_rank
    length = 8 * cp
    emb = torch.arange(length, dtype=torch.float32)[:, None, None, None].expand(length, 1, 1, 4)  # [S, 1, 1, dim]
    for r in range(cp):
        sliced = rope_utils.get_pos_emb_on_this_cp_rank(emb, 0, FakeGroup(cp, r))
        assert sliced[:, 0, 0, 0].long().tolist() == row_columns(length, cp, r).tolist()


def test_local_spec_gets_the_twin_only_at_context_parallel_above_1(tiny_llama_dir):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from dapo_mcore.config.model_spec import load_hf_config, read_model_spec
    from dapo_mcore.mcore.provider import _layer_specs, build_transformer_config

    spec = read_model_spec(load_hf_config(str(tiny_llama_dir)))

    def core(cp: int) -> list:
        config = build_transformer_config(spec, tp=1, pp=1, dtype="float32", on_cpu=True, use_te=False, cp=cp)
        assert config.context_parallel_size == cp and config.cp_comm_type == (None if cp == 1 else "p2p")
        return [
            layer.submodules.self_attention.submodules.core_attention for layer in _layer_specs(spec, config, False)
        ]

    assert core(1) == [DotProductAttention] * spec.num_layers
    assert core(2) == [CPAllGatherAttention] * spec.num_layers
    assert core(1) == [DotProductAttention] * spec.num_layers  # Megatron's own spec objects are left as they were
