"""Fused output layer + vocab-parallel log-prob and entropy, chunked over tokens, with its own backward.

A naive head materialises logits for every position, [T, V/tp] in bf16 and again in fp32, and keeps both
for backward: 25 GiB at 32k tokens x 128k vocab (REFERENCE.md section 5, complaint 5). Here the output
layer becomes a pass-through, and only the response positions go through the chunked head. For `chunk`
tokens at a time it computes z = hidden @ W_shard^T / T in fp32 and reduces it over the TP group to
log p(label) and entropy. Peak extra memory is O(chunk x V/tp), whatever the number of tokens. Two modes:

- `chunked_logprobs` (any use of the outputs: old log-probs, the reference model, any loss): keeps only
  the inputs and two scalars per token (the log-sum-exp and E_p[z]) for backward, where each chunk's logits
  are recomputed: one more [N, H] x [H, V/tp] matmul than a head that keeps its logits.
- `chunked_logprobs_with_loss_grad` (a loss that is a sum of per-token terms, such as DAPO's): the caller's
  per-token gradient is taken right after a chunk's log-probs are known, and the chunk's d hidden and
  d W_shard are accumulated there, in the forward. It keeps d hidden [N, H] (hidden's dtype) and
  d W_shard [V/tp, H] (the weight's dtype, accumulated in fp32) from forward to backward, which only scales
  them by the loss's incoming gradient: no logits recompute. The recompute mode keeps neither (its backward
  allocates the same two, briefly).

Gradients (z = logits / T, p = softmax(z), per token):
    d logp(y) / dz = onehot(y) - p,      d H / dz = -p (z - E_p[z])
    d hidden = (dL/dz / T) @ W_shard     (summed over TP ranks by the pass-through's backward)
    d W_shard = (dL/dz / T)^T @ hidden
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_MASKED = -1e30  # padded vocab columns: finite, so p * z stays 0

# loss_grad(a, b, logp_C, entropy_C) -> (dL/d logp_C, dL/d entropy_C or None) for tokens a:b
LossGradFn = Callable[[int, int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


def _all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)


@dataclass(frozen=True)
class _Shard:
    """This rank's vocab shard of the head: where it starts, the unpadded vocab, the logits' scale."""

    vocab_start: int
    true_vocab: int
    inv_temperature: float
    tp_group: Any
    chunk: int

    def ranges(self, n: int):
        return ((a, min(a + self.chunk, n)) for a in range(0, n, self.chunk))

    def logits(self, hidden_c: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """z = hidden_c @ W^T / T in (at least) fp32, padded vocab columns masked; one [C, V/tp] buffer."""
        z = (hidden_c @ weight.t()).to(_acc_dtype(hidden_c)).mul_(self.inv_temperature)
        if self.vocab_start + weight.shape[0] > self.true_vocab:  # this shard holds padding columns
            z[:, max(self.true_vocab - self.vocab_start, 0) :] = _MASKED
        return z


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _per_token_buffers(k: int, hidden: torch.Tensor) -> list[torch.Tensor]:
    """k separate [N] buffers (not views of one: outputs and saved tensors should own their storage)."""
    return [torch.empty(hidden.shape[0], dtype=_acc_dtype(hidden), device=hidden.device) for _ in range(k)]


def _rowwise_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_j a_ij b_ij without a [C, V] temporary."""
    return (a.unsqueeze(1) @ b.unsqueeze(2)).squeeze(2).squeeze(1)


def _label_columns(labels: torch.Tensor, vocab_start: int, v_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether this shard holds each label, its column here, clamped into range where it does not)."""
    local = (labels >= vocab_start) & (labels < vocab_start + v_local)
    return local, (labels - vocab_start).clamp(0, v_local - 1)


def _chunk_forward(hidden_c, weight, local_c, local_idx_c, shard: _Shard):
    """One chunk: (z, p, log p(label), entropy, log-sum-exp, E_p[z]), the last four reduced over TP.

    p lives in its own buffer and z is intact: two [C, V/tp] buffers, which the gradient then reuses.
    """
    z = shard.logits(hidden_c, weight)
    z_max = z.amax(dim=-1)
    _all_reduce(z_max, shard.tp_group, dist.ReduceOp.MAX)
    exp_z = (z - z_max.unsqueeze(-1)).exp_()
    sum_exp = exp_z.sum(dim=-1)
    _all_reduce(sum_exp, shard.tp_group)
    lse = z_max + sum_exp.log()
    p = exp_z.div_(sum_exp.unsqueeze(-1))
    target = z.gather(-1, local_idx_c.unsqueeze(-1)).squeeze(-1) * local_c
    sums = torch.stack([target, _rowwise_dot(p, z)])
    _all_reduce(sums, shard.tp_group)
    return z, p, sums[0] - lse, lse - sums[1], lse, sums[1]


def _grad_logits(z, p, expected_z, grad_logp, grad_entropy, local_c, local_idx_c, inv_temperature):
    """dL/d(hidden @ W^T) for one chunk, = (onehot(y) g_logp - p (g_logp + g_ent (z - E_p[z]))) / T, built in
    z's or p's buffer (both are spent afterwards). g_ent None: the loss has no entropy term."""
    if grad_entropy is None:
        grad_z = p.mul_(-grad_logp.unsqueeze(-1))
    else:
        grad_z = z.sub_(expected_z.unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1))
        grad_z.add_(grad_logp.unsqueeze(-1)).mul_(p).neg_()
    grad_z.scatter_add_(-1, local_idx_c.unsqueeze(-1), (grad_logp * local_c).unsqueeze(-1))
    return grad_z.mul_(inv_temperature)


class _ChunkedLinearLogProb(torch.autograd.Function):
    """Log-probs and entropies; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, shard: _Shard):
        n = hidden.shape[0]
        logp, entropy, log_sum_exp, expected_z = _per_token_buffers(4, hidden)
        local, local_idx = _label_columns(labels, shard.vocab_start, weight.shape[0])
        for a, b in shard.ranges(n):
            z, p, logp[a:b], entropy[a:b], log_sum_exp[a:b], expected_z[a:b] = _chunk_forward(
                hidden[a:b], weight, local[a:b], local_idx[a:b], shard
            )
            del z, p
        ctx.save_for_backward(hidden, weight, local_idx, local, log_sum_exp, expected_z)
        ctx.shard = shard
        ctx.set_materialize_grads(False)  # entropy is usually only a metric: then no gradient arrives for it
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, local_idx, local, log_sum_exp, expected_z = ctx.saved_tensors
        shard = ctx.shard
        if grad_logp is None:
            grad_logp = torch.zeros_like(log_sum_exp)
        grad_hidden = torch.zeros_like(hidden, dtype=_acc_dtype(hidden))
        grad_weight = torch.zeros_like(weight, dtype=grad_hidden.dtype)
        for a, b in shard.ranges(hidden.shape[0]):
            z = shard.logits(hidden[a:b], weight)
            p = (z - log_sum_exp[a:b].unsqueeze(-1)).exp_()
            grad_z = _grad_logits(
                z,
                p,
                expected_z[a:b],
                grad_logp[a:b],
                None if grad_entropy is None else grad_entropy[a:b],
                local[a:b],
                local_idx[a:b],
                shard.inv_temperature,
            )
            del p
            grad_hidden[a:b] = grad_z @ weight.to(grad_z.dtype)
            grad_weight.addmm_(grad_z.t(), hidden[a:b].to(grad_z.dtype))
        return grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype), None, None


class _ChunkedLinearLogProbLossGrad(torch.autograd.Function):
    """Log-probs, entropies (no gradient flows through them) and a zero scalar whose gradient is the loss's:
    d hidden and d W_shard are accumulated in the forward chunk loop, backward scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, shard: _Shard, loss_grad: LossGradFn):
        n = hidden.shape[0]
        logp, entropy = _per_token_buffers(2, hidden)
        local, local_idx = _label_columns(labels, shard.vocab_start, weight.shape[0])
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=_acc_dtype(hidden)) if want_weight else None
        weight_acc = weight.to(_acc_dtype(hidden))  # once, not per chunk (a no-op in fp32)
        for a, b in shard.ranges(n):
            z, p, logp[a:b], entropy[a:b], _, expected_z = _chunk_forward(
                hidden[a:b], weight, local[a:b], local_idx[a:b], shard
            )
            grad_logp, grad_entropy = loss_grad(a, b, logp[a:b], entropy[a:b])
            grad_z = _grad_logits(
                z, p, expected_z, grad_logp, grad_entropy, local[a:b], local_idx[a:b], shard.inv_temperature
            )
            del z, p
            if want_hidden:
                grad_hidden[a:b] = grad_z @ weight_acc
            if want_weight:
                grad_weight.addmm_(grad_z.t(), hidden[a:b].to(grad_z.dtype))
        ctx.grads = (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype))
        ctx.mark_non_differentiable(logp, entropy)
        return logp, entropy, logp.new_zeros(())

    @staticmethod
    def backward(ctx, _grad_logp, _grad_entropy, grad_anchor):
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None  # d hidden and d W are handed over (and scaled in place): backward runs once
        if grad_anchor is None:  # the loss did not use the anchor
            return None, None, None, None, None
        scale = [g if g is None else g.mul_(grad_anchor.to(g.dtype)) for g in (grad_hidden, grad_weight)]
        return *scale, None, None, None


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
    shard = _shard(vocab_start, true_vocab, temperature, tp_group, chunk)
    return _ChunkedLinearLogProb.apply(hidden, weight, labels, shard)


def chunked_logprobs_with_loss_grad(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    loss_grad: LossGradFn,
    *,
    vocab_start: int,
    true_vocab: int,
    temperature: float = 1.0,
    tp_group=None,
    chunk: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log p(labels) [N], entropy [N], anchor []) for a loss L whose gradient is per token.

    `loss_grad(a, b, logp_C, entropy_C)` gives dL/dlogp and dL/dentropy (None: L has no entropy term) of
    tokens a:b, from their (TP-reduced) values alone; it is called once per chunk, in this forward. The
    log-probs and entropies carry no gradient: add `anchor` (a zero) to the loss, times any constant factor
    the loss applies after the per-token sum, and its gradient reaches hidden and weight.
    """
    shard = _shard(vocab_start, true_vocab, temperature, tp_group, chunk)
    return _ChunkedLinearLogProbLossGrad.apply(hidden, weight, labels, shard, loss_grad)


def _shard(vocab_start, true_vocab, temperature, tp_group, chunk) -> _Shard:
    if tp_group is not None and dist.get_world_size(tp_group) == 1:
        tp_group = None
    return _Shard(vocab_start, true_vocab, 1.0 / temperature, tp_group, chunk)


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
