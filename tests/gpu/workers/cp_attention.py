"""Worker for the context-parallel attention test at C = 1 (one process on CUDA, run under torchrun): Megatron's
TEDotProductAttention (Transformer Engine, the actor's core attention with TE layers) against the CPU twin
CPAllGatherAttention (dapo_mcore/mcore/cp_attention.py) on the same bf16 queries, keys and values, packed THD
rows (cu_seqlens as the actor's thd_params gives them at C = 1) and causal bshd rows.

    torchrun --nproc_per_node 1 cp_attention.py OUT

Saved to OUT: {"thd": {"te": [output, dQ, dK, dV], "twin": [...]}, "bshd": {...}}; the
twin runs in fp32 on the bf16 inputs upcast (the reference), TE in bf16; all on the CPU.
"""

import argparse

import torch

from dapo_mcore.mcore.cp_attention import CPAllGatherAttention
from dapo_mcore.parallel import destroy_parallel, init_parallel

HEADS, GROUPS, HEAD_DIM = 8, 2, 64  # grouped-query attention; a head size TE's fused kernels take
LENGTHS = [37, 128, 1, 90, 6, 250]  # one sequence of one token; lengths need no multiple of 2C at C = 1
BSHD = (256, 2)  # [s, b]


def config(dtype: torch.dtype):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=HEAD_DIM,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        cp_comm_type="p2p",  # what build_transformer_config gives TE THD (all_gather refuses THD)
    )


def attentions(ctx):
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    def kwargs(dtype):
        return dict(
            config=config(dtype),
            layer_number=1,
            attn_mask_type=AttnMaskType.causal,
            attention_type="self",
            softmax_scale=None,
            cp_comm_type="p2p",
            pg_collection=ctx.pg,
        )

    return TEDotProductAttention(**kwargs(torch.bfloat16)), CPAllGatherAttention(**kwargs(torch.float32))


def output_and_grads(attention, inputs, upstream, **kwargs) -> list[torch.Tensor]:
    inputs = [x.detach().requires_grad_() for x in inputs]
    out = attention(*inputs, None, **kwargs)
    grads = torch.autograd.grad(out, inputs, upstream.to(out.dtype).view(out.shape))
    return [t.detach().float().cpu() for t in (out, *grads)]


def qkv(lead: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [
        torch.randn(*lead, heads, HEAD_DIM, generator=g, device="cuda").bfloat16() for heads in (HEADS, GROUPS, GROUPS)
    ]


def compare(te, twin, inputs, **kwargs) -> dict:
    g = torch.Generator(device="cuda").manual_seed(99)
    upstream = torch.randn(*inputs[0].shape[:-2], HEADS * HEAD_DIM, generator=g, device="cuda")
    return {
        "te": output_and_grads(te, inputs, upstream, **kwargs),
        "twin": output_and_grads(twin, [x.float() for x in inputs], upstream, **kwargs),
    }


def main():
    from megatron.core.packed_seq_params import PackedSeqParams

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    args = ap.parse_args()
    ctx = init_parallel(1, 1, "cuda")
    te, twin = attentions(ctx)
    cu = torch.nn.functional.pad(torch.tensor(LENGTHS).cumsum(0), (1, 0)).to(device="cuda", dtype=torch.int32)
    # as the actor's thd_params at C = 1 (mcore/actor.py): cu_seqlens only, [t, heads, d] (batch squeezed)
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS)
    )
    result = {
        "thd": compare(te, twin, qkv((sum(LENGTHS),), seed=1), packed_seq_params=params),
        "bshd": compare(te, twin, qkv(BSHD, seed=2)),
    }
    torch.save(result, args.out)
    destroy_parallel()


if __name__ == "__main__":
    main()
