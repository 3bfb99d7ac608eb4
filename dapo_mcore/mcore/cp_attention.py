"""The CPU twin of context-parallel attention (docs/design/context_parallel.md sections 2 and 4).

Megatron-Core's local core attention (DotProductAttention) refuses context parallelism (CP) and packed (THD) rows;
Transformer Engine's CP attention needs a GPU. CPAllGatherAttention takes DotProductAttention's place in the local
layer spec at CP > 1 (mcore/provider.py `_layer_specs`): each CP rank holds its queries, keys and values at its own
columns of the row (Megatron's load-balanced split: chunks r and 2C-1-r of 2C, per sequence under THD), all-gathers
K and V over the CP group (backward: their gradients reduce-scattered, as Transformer Engine's all_gather mode),
puts the gathered keys back in global column order and attends with "same sequence and key column <= query column".
Scores are [b * heads, local queries, all keys] in fp32: quadratic, for tests and the CPU (the planner's local-layer
line). At CP 1 it is a plain attention: DotProductAttention's result on bshd rows, the block-mask path's on THD rows.

Shape legend: s local sequence (this CP rank's columns), S whole row, b batch, n query heads of this TP rank,
g key/value groups of this TP rank, d head size, t local packed tokens (THD), T whole packed row.
"""

from __future__ import annotations

import math

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch import Tensor

from dapo_mcore.data.batching import row_cp_columns, thd_cp_columns


class CPAllGatherAttention(MegatronModule):
    """Core attention with DotProductAttention's constructor and forward (MC/transformer/attention.py protocols
    CoreAttentionBuilder and CoreAttention), for any CP size, bshd and THD. The CP group is the layer's
    `pg_collection.cp` (the one Attention hands in; no global getter). No parameters."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config=config)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"CPAllGatherAttention has no attention dropout (asked for {dropout})")
        if config.softmax_type != "vanilla" or config.window_size is not None:
            raise ValueError("CPAllGatherAttention supports the vanilla softmax without a sliding window only")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.cp_comm_type = cp_comm_type  # recorded only: K and V are always all-gathered
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        self.cp_group = getattr(pg_collection, "cp", None)
        tp = self.tp_group.size()
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        # DotProductAttention's net scale: with apply_query_key_layer_scaling it divides the scale by the layer
        # number and its softmax multiplies it back (FusedScaleMaskSoftmax scale=coeff), so 1/sqrt(d) remains.
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        """bshd: query [s, b, n, d], key/value [s, b, g, d] -> [s, b, n * d]; THD: query [t, n, d], key/value
        [t, g, d] -> [t, n * d] (Attention squeezed the batch dimension and restores it)."""
        if attention_bias is not None:
            raise ValueError("CPAllGatherAttention does not take an attention bias")
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if packed_seq_params is not None and not thd:
            raise ValueError(f"CPAllGatherAttention: packed_seq_params of format {packed_seq_params.qkv_format}")
        if thd:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        cp = 1 if self.cp_group is None else self.cp_group.size()
        rank = 0 if self.cp_group is None else self.cp_group.rank()
        local = query.size(0)
        if attention_mask is not None and (cp > 1 or thd):
            raise ValueError("CPAllGatherAttention takes an explicit attention mask only at CP 1 on bshd rows")

        if thd:
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            cu = cu.to(device="cpu", dtype=torch.long)
            if int(cu[-1]) != local * cp:
                raise ValueError(f"cu_seqlens end at {int(cu[-1])}, the CP group holds {local} x {cp} tokens")
            columns = [thd_cp_columns(cu, cp, r) for r in range(cp)]
        else:
            columns = [row_cp_columns(local * cp, cp, r) for r in range(cp)]

        if cp > 1:
            # forward: all-gather along dim 0 in CP-rank order; backward: reduce-scatter (sum) of dK, dV
            key = gather_from_sequence_parallel_region(key, tensor_parallel_output_grad=True, group=self.cp_group)
            value = gather_from_sequence_parallel_region(value, tensor_parallel_output_grad=True, group=self.cp_group)
            # back to global column order: gathered key j is column cat(columns)[j]
            order = torch.argsort(torch.cat(columns)).to(key.device)
            key, value = key.index_select(0, order), value.index_select(0, order)

        if attention_mask is not None:
            allowed_ss = ~attention_mask  # Megatron's masks are True where attention is masked: [b or 1, 1, s, s]
        else:
            allowed_ss = self._allowed(columns[rank], local * cp, cu if thd else None).to(query.device)
        context = self._attend(query, key, value, allowed_ss)  # [s, b, n * d]
        return context.squeeze(1) if thd else context

    @staticmethod
    def _allowed(query_columns: Tensor, length: int, cu_seqlens: Tensor | None) -> Tensor:
        """[s, S] True where a query (at its global column) may attend a key (keys in global column order): the
        key's column is not after the query's and, packed, both are in the same sequence."""
        key_columns = torch.arange(length)
        allowed = key_columns[None, :] <= query_columns[:, None]
        if cu_seqlens is not None:
            sequence_of = torch.bucketize(torch.arange(length), cu_seqlens[1:], right=True)  # [S]
            allowed &= sequence_of[None, :] == sequence_of[query_columns][:, None]
        return allowed

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, allowed: Tensor) -> Tensor:
        s, b = query.shape[:2]
        if self.heads > self.groups:  # grouped-query attention: each key/value group serves heads/groups queries
            key = key.repeat_interleave(self.heads // self.groups, dim=2)
            value = value.repeat_interleave(self.heads // self.groups, dim=2)
        q = query.permute(1, 2, 0, 3)  # [b, n, s, d]
        k = key.permute(1, 2, 3, 0)  # [b, n, d, S]
        v = value.permute(1, 2, 0, 3)  # [b, n, S, d]
        scores = torch.matmul(q, k).float() * self.softmax_scale  # [b, n, s, S] fp32
        scores = scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1).to(value.dtype)
        context = torch.matmul(probs, v)  # [b, n, s, d]
        return context.permute(2, 0, 1, 3).reshape(s, b, -1)
