"""Fused output layer + vocab-parallel log-prob and entropy, chunked over tokens, with its own backward.

A naive head materialises logits for every position, [T, V/tp] in bf16 and again in fp32, and keeps both
for backward: 25 GiB at 32k tokens x 128k vocab (REFERENCE.md section 5, complaint 5). Here the output
layer becomes a pass-through, and only the response positions go through `_ChunkedLinearLogProb`. For
`chunk` tokens at a time it computes z = hidden @ W_shard^T / T in fp32 and reduces it over the TP group
to log p(label) and entropy. It keeps only the inputs and two scalars per token (the log-sum-exp and E_p[z])
for backward, where each chunk's logits are recomputed. Peak extra memory is O(chunk x V/tp), whatever the
number of tokens.

Gradients (z = logits / T, p = softmax(z), per token):
    d logp(y) / dz = onehot(y) - p,      d H / dz = -p (z - E_p[z])
    d hidden = (dL/dz / T) @ W_shard     (summed over TP ranks by the pass-through's backward)
    d W_shard = (dL/dz / T)^T @ hidden
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist

_MASKED = -1e30  # padded vocab columns: finite, so p * z stays 0


def _all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)


def _chunk_logits(hidden_c, weight, vocab_start, true_vocab, inv_temperature):
    """z = hidden_c @ W^T / T in (at least) fp32, padded vocab columns masked; one [C, V/tp] buffer."""
    z = (hidden_c @ weight.t()).to(torch.promote_types(hidden_c.dtype, torch.float32)).mul_(inv_temperature)
    if vocab_start + weight.shape[0] > true_vocab:  # this shard holds padding columns
        z[:, max(true_vocab - vocab_start, 0) :] = _MASKED
    return z


def _rowwise_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_j a_ij b_ij without a [C, V] temporary."""
    return (a.unsqueeze(1) @ b.unsqueeze(2)).squeeze(2).squeeze(1)


class _ChunkedLinearLogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, vocab_start, true_vocab, inv_temperature, tp_group, chunk):
        n, v_local = hidden.shape[0], weight.shape[0]
        out_dtype = torch.promote_types(hidden.dtype, torch.float32)
        logp, entropy = (
            torch.empty(n, dtype=out_dtype, device=hidden.device),
            torch.empty_like(hidden[:, 0], dtype=out_dtype),
        )
        log_sum_exp, expected_z = torch.empty_like(logp), torch.empty_like(logp)
        local = (labels >= vocab_start) & (labels < vocab_start + v_local)
        local_idx = (labels - vocab_start).clamp(0, v_local - 1)
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            z = _chunk_logits(hidden[a:b], weight, vocab_start, true_vocab, inv_temperature)
            z_max = z.amax(dim=-1)
            _all_reduce(z_max, tp_group, dist.ReduceOp.MAX)
            exp_z = (z - z_max.unsqueeze(-1)).exp_()
            sum_exp = exp_z.sum(dim=-1)
            _all_reduce(sum_exp, tp_group)
            lse = z_max + sum_exp.log()
            p = exp_z.div_(sum_exp.unsqueeze(-1))
            target = z.gather(-1, local_idx[a:b].unsqueeze(-1)).squeeze(-1) * local[a:b]
            sums = torch.stack([target, _rowwise_dot(p, z)])
            del z, p
            _all_reduce(sums, tp_group)
            logp[a:b], entropy[a:b] = sums[0] - lse, lse - sums[1]
            log_sum_exp[a:b], expected_z[a:b] = lse, sums[1]
        ctx.save_for_backward(hidden, weight, local_idx, local, log_sum_exp, expected_z)
        ctx.settings = (vocab_start, true_vocab, inv_temperature, chunk)
        ctx.set_materialize_grads(False)  # entropy is usually only a metric: then no gradient arrives for it
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, local_idx, local, log_sum_exp, expected_z = ctx.saved_tensors
        vocab_start, true_vocab, inv_temperature, chunk = ctx.settings
        if grad_logp is None:
            grad_logp = torch.zeros_like(log_sum_exp)
        grad_hidden = torch.zeros_like(hidden, dtype=torch.promote_types(hidden.dtype, torch.float32))
        grad_weight = torch.zeros_like(weight, dtype=grad_hidden.dtype)
        for a in range(0, hidden.shape[0], chunk):
            b = min(a + chunk, hidden.shape[0])
            z = _chunk_logits(hidden[a:b], weight, vocab_start, true_vocab, inv_temperature)
            p = (z - log_sum_exp[a:b].unsqueeze(-1)).exp_()
            # grad_z = -p * (g_logp + g_ent * (z - E[z])), built in z's buffer: two [C, V/tp] buffers in all
            if grad_entropy is None:
                grad_z = p.mul_(-grad_logp[a:b].unsqueeze(-1))
            else:
                grad_z = z.sub_(expected_z[a:b].unsqueeze(-1)).mul_(grad_entropy[a:b].unsqueeze(-1))
                grad_z.add_(grad_logp[a:b].unsqueeze(-1)).mul_(p).neg_()
            del p
            grad_z.scatter_add_(-1, local_idx[a:b].unsqueeze(-1), (grad_logp[a:b] * local[a:b]).unsqueeze(-1))
            grad_z.mul_(inv_temperature)
            grad_hidden[a:b] = grad_z @ weight.to(grad_z.dtype)
            grad_weight.addmm_(grad_z.t(), hidden[a:b].to(grad_z.dtype))
        return grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype), None, None, None, None, None, None


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_start: int,
    true_vocab: int,
    temperature: float = 1.0,
    tp_group=None,
    chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(labels), entropy) for hidden [N, H] against this rank's vocab shard weight [V/tp, H]."""
    if tp_group is not None and dist.get_world_size(tp_group) == 1:
        tp_group = None
    return _ChunkedLinearLogProb.apply(
        hidden, weight, labels, vocab_start, true_vocab, 1.0 / temperature, tp_group, chunk
    )


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous.

    Megatron-Core 0.16's TP mappings all-reduce `grad.contiguous()` and return `grad`: for a non-contiguous
    gradient (GPTModel hands back the gradient of `logits.transpose(0, 1)`) the reduction lands in a copy
    and is lost. Megatron's own output layer reduces in its own backward and never meets this.
    """

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def install_passthrough_head(gpt_model: Any, tp_group) -> None:
    """Make GPTModel's output layer return its (full-sequence, TP-replicated) input instead of logits.

    It does what ColumnParallelLinear does to its input before the matmul: a sequence-parallel all-gather
    (reduce-scatter in backward), or an identity whose backward all-reduces over TP (each rank's vocab
    shard contributes part of d hidden). The model's output is then hidden states [b, s, H].
    """
    from megatron.core.tensor_parallel import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    layer = gpt_model.output_layer

    def passthrough(self, input_, weight=None, runtime_gather_output=None, **kwargs):
        if self.sequence_parallel:
            return _ContiguousGrad.apply(gather_from_sequence_parallel_region(input_, group=tp_group)), None
        return _ContiguousGrad.apply(copy_to_tensor_model_parallel_region(input_, group=tp_group)), None

    layer.forward = types.MethodType(passthrough, layer)


def output_weight(gpt_model: Any) -> torch.Tensor:
    """The vocab-sharded [V/tp, H] weight of the output layer (the embedding's, when they are tied)."""
    if gpt_model.share_embeddings_and_output_weights:
        return gpt_model.shared_embedding_or_output_weight()
    return gpt_model.output_layer.weight
