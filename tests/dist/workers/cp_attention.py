"""Worker (2 gloo ranks under torchrun): the CPU twin of context-parallel attention at CP 2 against CP 1.

    torchrun --nproc_per_node 2 cp_attention.py HF_DIR

The CP group (both ranks) is made here with torch.distributed; each rank also computes the CP-1 reference alone.
1. The core attention alone, bshd and THD rows: each rank's output rows, dQ and (after the reduce-scatter) dK, dV
   equal the CP-1 ones at the rank's columns.
2. A tiny GPTModel (the project's local spec, HF_DIR's architecture) at CP 2: logits at each rank's columns equal
   CP 1's (Megatron's own RoPE slicing per CP rank against our layouts), bshd rows and packed THD rows (the CP-1
   reference there is the block-mask path); the weight gradients summed over the CP ranks equal CP 1's.
Fails (non-zero exit) on the first difference.
"""

import dataclasses
import sys

import torch
import torch.distributed as dist

from dapo_mcore.config.model_spec import load_hf_config, read_model_spec
from dapo_mcore.data.batching import block_causal_mask
from dapo_mcore.data.batching import row_cp_columns as row_columns
from dapo_mcore.data.batching import thd_cp_columns as thd_columns
from dapo_mcore.mcore.cp_attention import CPAllGatherAttention
from dapo_mcore.mcore.provider import _layer_specs, _local_block, build_transformer_config, padded_vocab_size
from dapo_mcore.parallel import destroy_parallel, init_parallel
from tests.unit.test_cp_attention import GROUPS, HEAD_DIM, HEADS, attention_config

CP = 2

ATOL, LOGITS_ATOL = 1e-6, 1e-5


def with_cp(pg, cp_group):
    """A copy of Megatron's ProcessGroupCollection whose cp group is cp_group."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    present = {f.name: getattr(pg, f.name) for f in dataclasses.fields(pg) if hasattr(pg, f.name)}
    return ProcessGroupCollection(**{**present, "cp": cp_group})


def twin(pg, cp: int) -> CPAllGatherAttention:
    from megatron.core.transformer.enums import AttnMaskType

    config = attention_config(cp)  # the unit tests' (tests/unit/test_cp_attention.py): the same shape
    return CPAllGatherAttention(
        config=config,
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        cp_comm_type="all_gather",
        softmax_scale=None,
        pg_collection=pg,
    )


def run_attention(attention, q, k, v, upstream, **kwargs):
    inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = attention(*inputs, None, **kwargs)
    out.backward(upstream)
    return [out.detach(), *(x.grad for x in inputs)]


def check(name: str, got: torch.Tensor, want: torch.Tensor, atol: float) -> float:
    torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=lambda m: f"rank {dist.get_rank()} {name}: {m}")
    return float((got - want).abs().max()) if got.numel() else 0.0


def attention_alone(pg1, pg2) -> None:
    rank = pg2.cp.rank()
    g = torch.Generator().manual_seed(0)
    for layout in ("bshd", "thd"):
        if layout == "bshd":
            s, b, kwargs1 = 32, 3, {}
            cols = row_columns(s, CP, rank)
            kwargs2 = {}
        else:
            from megatron.core.packed_seq_params import PackedSeqParams

            lengths = [8, 4, 12, 4, 4]  # each a multiple of 2 CP (the slots' padding granule)
            s, b = sum(lengths), 1
            cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
            params = PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=12, max_seqlen_kv=12
            )
            cols = thd_columns(cu, CP, rank)
            kwargs1 = kwargs2 = {"packed_seq_params": params}
        q = torch.randn(s, b, HEADS, HEAD_DIM, generator=g)
        k, v = (torch.randn(s, b, GROUPS, HEAD_DIM, generator=g) for _ in range(2))
        upstream = torch.randn(s, b, HEADS * HEAD_DIM, generator=g) / s  # a mean over the rows, as the actor's loss
        if layout == "thd":  # Attention squeezes the batch dimension for THD
            q, k, v, upstream = (x.squeeze(1) for x in (q, k, v, upstream))
        whole = run_attention(twin(pg1, 1), q, k, v, upstream, **kwargs1)
        mine = run_attention(twin(pg2, CP), q[cols], k[cols], v[cols], upstream[cols], **kwargs2)
        worst = max(check(f"{layout} {n}", m, w[cols], ATOL) for n, m, w in zip(("out", "dQ", "dK", "dV"), mine, whole))
        print(f"rank {rank}: attention {layout} at CP 2 == CP 1 at its columns (max diff {worst:.1e})", flush=True)


def gpt(spec, pg, cp: int):
    from megatron.core.models.gpt import GPTModel

    config = build_transformer_config(spec, tp=1, pp=1, dtype="float32", on_cpu=True, use_te=False, cp=cp)
    return GPTModel(
        config=config,
        transformer_layer_spec=_local_block(_layer_specs(spec, config, False), False),
        vocab_size=padded_vocab_size(spec.vocab_size, 1),
        max_sequence_length=spec.max_position_embeddings,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=spec.rope_theta,
        pg_collection=pg,
    )


def whole_model(hf_dir: str, pg1, pg2) -> None:
    from megatron.core.packed_seq_params import PackedSeqParams

    rank = pg2.cp.rank()
    spec = read_model_spec(load_hf_config(hf_dir))
    torch.manual_seed(0)
    model1 = gpt(spec, pg1, 1)
    for param in model1.parameters():  # the CP ranks hold one model
        dist.broadcast(param.data, 0, group=pg2.cp)
    model2 = gpt(spec, pg2, CP)
    model2.load_state_dict(model1.state_dict())
    cores = {type(layer.self_attention.core_attention).__name__ for layer in model2.decoder.layers}
    assert cores == {"CPAllGatherAttention"}, cores

    g = torch.Generator().manual_seed(1)
    lengths = [12, 8, 8, 4]
    total = sum(lengths)
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    segment_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    cases = {
        # rows of one sample each (packing off): causal, the row split
        "bshd": (torch.randint(4, spec.vocab_size, (2, 16), generator=g), None, None),
        # packed rows: the block mask at CP 1, THD with the global cu_seqlens at CP 2
        "thd": (
            torch.randint(4, spec.vocab_size, (1, total), generator=g),
            block_causal_mask(segment_ids),
            PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=12
            ),
        ),
    }
    for layout, (tokens, mask, params) in cases.items():
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        cols = row_columns(tokens.shape[1], CP, rank) if params is None else thd_columns(cu, CP, rank)
        # a loss of the logits as the actor's: a mean over the row's tokens (its gradients at the actor's scale)
        weight = torch.randn(*tokens.shape, padded_vocab_size(spec.vocab_size, 1), generator=g) / tokens.numel()
        model1.zero_grad(set_to_none=True)
        model2.zero_grad(set_to_none=True)
        logits1 = model1(tokens, positions, mask)
        (logits1 * weight).sum().backward()
        extra = {} if params is None else {"packed_seq_params": params}
        logits2 = model2(tokens[:, cols], positions[:, cols], None, **extra)
        (logits2 * weight[:, cols]).sum().backward()
        worst = check(f"{layout} logits", logits2.detach(), logits1.detach()[:, cols], LOGITS_ATOL)
        grads1 = dict(model1.named_parameters())
        worst_grad = scale = 0.0
        for name, param in model2.named_parameters():
            grad = param.grad.clone()
            dist.all_reduce(grad, group=pg2.cp)  # what DDP's dp_cp reduction adds up
            worst_grad = max(worst_grad, check(f"{layout} grad {name}", grad, grads1[name].grad, ATOL))
            scale = max(scale, float(grads1[name].grad.abs().max()))
        print(
            f"rank {rank}: GPTModel {layout} at CP 2 == CP 1 at its columns (logits {worst:.1e}, "
            f"CP-summed gradients {worst_grad:.1e}, largest {scale:.1e})",
            flush=True,
        )


def main() -> None:
    hf_dir = sys.argv[1]
    ctx = init_parallel(1, 1, "cpu")  # the CPU mode, Megatron's TP group (size 1), CP 1
    assert ctx.world_size == CP
    # every rank makes every group, in the same order: the CP group (both ranks) and one of each rank alone (CP 1)
    cp_group = dist.new_group([0, 1], backend="gloo")
    alone = [dist.new_group([r], backend="gloo") for r in range(CP)]
    pg1, pg2 = with_cp(ctx.pg, alone[ctx.rank]), with_cp(ctx.pg, cp_group)
    attention_alone(pg1, pg2)
    whole_model(hf_dir, pg1, pg2)
    destroy_parallel()


if __name__ == "__main__":
    main()
