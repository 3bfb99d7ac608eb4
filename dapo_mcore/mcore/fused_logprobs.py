"""Fused output layer + vocab-parallel log-prob and entropy, chunked over tokens, with its own backward.

A naive head materialises logits for every position, [T, V/tp] in bf16 and again in fp32, and keeps both
for backward: 25 GiB at 32k tokens x 128k vocab (REFERENCE.md section 5, complaint 5). Here the output
layer becomes a pass-through, and only the response positions go through the chunked head. For `chunk`
tokens at a time it computes z = hidden @ W_shard^T / T and reduces it over the TP group to log p(label) and
entropy. Peak extra memory is O(chunk x V/tp), whatever the number of tokens, plus d W_shard [V/tp, H] in
fp32 and d hidden [N, H]: no [N, V] tensor. Two modes:

- `chunked_logprobs` (any use of the outputs: old log-probs, the reference model, any loss): keeps only
  the inputs and two scalars per token (the log-sum-exp and the entropy) for backward, where each chunk's
  logits are recomputed: one more [N, H] x [H, V/tp] matmul than a head that keeps its logits.
- `chunked_logprobs_with_loss_grad` (a loss that is a sum of per-token terms, such as DAPO's): the caller's
  per-token gradient is taken right after a chunk's log-probs are known, and the chunk's d hidden and
  d W_shard are accumulated there, in the forward. It keeps d hidden [N, H] (hidden's dtype) and
  d W_shard [V/tp, H] (the weight's dtype, accumulated in fp32) from forward to backward, which only scales
  them by the loss's incoming gradient: no logits recompute. The recompute mode keeps neither (its backward
  allocates the same two, briefly). Without an entropy term in the loss a chunk needs one fp32 [C, V/tp]
  buffer (`_logp_grad_step`), with one two (`_logp_entropy_grad_step`), plus a bf16 copy (below).

Dtypes, as Megatron's output layer: every matmul over the vocab ([C, H] x [H, V/tp] for the logits,
[C, V/tp] x [V/tp, H] for d hidden, [V/tp, C] x [C, H] for d W_shard) runs in the params' dtype (that of
`weight` and `hidden`): an H100 runs fp32 matmuls at a fraction of its bf16 rate. The softmax, its sums and
the per-token scalars are in fp32 (`_acc_dtype`), and the fp32 [C, V/tp] buffer (e or dL/dz) is cast to
the params' dtype right before its matmuls: for a bf16 model one more bf16 [C, V/tp] buffer per chunk (half
of an fp32 one), and a bf16 [V/tp, H] temporary per chunk for d W_shard's product (half of its fp32
accumulator, see `_accumulate_mm`). d W_shard is accumulated over chunks in fp32, d hidden is written in
hidden's dtype. For an fp32 or float64 model every cast is a no-op: nothing changes.

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
        """z = hidden_c @ W^T / T, the matmul in the params' dtype, z in (at least) fp32, padded vocab columns
        masked; one [C, V/tp] buffer."""
        z = (hidden_c @ weight.t()).to(_acc_dtype(hidden_c))
        if self.inv_temperature != 1.0:  # a pass over [C, V/tp] saved at T = 1
            z.mul_(self.inv_temperature)
        if self.vocab_start + weight.shape[0] > self.true_vocab:  # this shard holds padding columns
            z[:, max(self.true_vocab - self.vocab_start, 0) :] = _MASKED
        return z


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, for a and b in the params' dtype and acc in `_acc_dtype` (d W over chunks).

    A bf16 a @ b accumulates in fp32 inside the matmul and rounds its output to bf16 once per chunk, as
    Megatron's wgrad does without gradient-accumulation fusion; the sum over chunks stays in fp32 (bf16 chunk
    products added into a bf16 accumulator would lose the small ones). torch.mm(a, b, out_dtype=fp32) would
    skip that rounding, but torch 2.13 implements it on CUDA only, not on the CPU.
    """
    if a.dtype == acc.dtype:  # fp32 / float64 model: in place, no [V/tp, H] temporary
        acc.addmm_(a, b)
    else:
        acc.add_(a @ b)


def _per_token_buffers(k: int, hidden: torch.Tensor) -> list[torch.Tensor]:
    """k separate [N] buffers (not views of one: outputs and saved tensors should own their storage)."""
    return [torch.empty(hidden.shape[0], dtype=_acc_dtype(hidden), device=hidden.device) for _ in range(k)]


def _label_columns(labels: torch.Tensor, vocab_start: int, v_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether this shard holds each label, its column here, clamped into range where it does not)."""
    local = (labels >= vocab_start) & (labels < vocab_start + v_local)
    return local, (labels - vocab_start).clamp(0, v_local - 1)


def _chunk_forward(hidden_c, weight, local_c, local_idx_c, shard: _Shard):
    """One chunk: e = exp(z - m) and ez = e (z - m) with m the row max (two [C, V/tp] buffers, every op in
    place after the exp), then the TP-reduced per-token (log p(label), entropy, sum e, E_p[z - m], m)."""
    z = shard.logits(hidden_c, weight)
    z_max = z.amax(dim=-1)
    _all_reduce(z_max, shard.tp_group, dist.ReduceOp.MAX)
    z.sub_(z_max.unsqueeze(-1))
    target = z.gather(-1, local_idx_c.unsqueeze(-1)).squeeze(-1) * local_c
    e = torch.exp(z)
    ez = z.mul_(e)
    sums = torch.stack([e.sum(dim=-1), ez.sum(dim=-1), target])  # one all-reduce for the three
    _all_reduce(sums, shard.tp_group)
    sum_e, shifted_mean = sums[0], sums[1] / sums[0]
    log_sum_e = sum_e.log()
    return e, ez, sums[2] - log_sum_e, log_sum_e - shifted_mean, sum_e, shifted_mean, z_max


def _grad_logits(e, ez, inv_sum_e, shifted_mean, grad_logp, grad_entropy, local_c, local_idx_c, inv_temperature):
    """dL/d(hidden @ W^T) for one chunk, in e's buffer, from e = exp(z - c) and ez = e (z - c) for any per-token
    shift c. With p = e / sum e and E' = E_p[z - c]:
        dL/dz = onehot(y) g_logp - p g_logp - g_ent p (z - E_p[z])
              = onehot(y) g_logp + e (g_ent E' - g_logp) / sum e - ez g_ent / sum e,
    all / T. A per-row scale of e, plus one of ez when the loss has an entropy term (g_ent not None)."""
    coef_e = grad_logp if grad_entropy is None else grad_logp - grad_entropy * shifted_mean
    grad_z = e.mul_((coef_e * (-inv_temperature * inv_sum_e)).unsqueeze(-1))
    if grad_entropy is not None:
        grad_z.addcmul_(ez, (grad_entropy * (-inv_temperature * inv_sum_e)).unsqueeze(-1))
    label_grad = (grad_logp * local_c) * inv_temperature
    return grad_z.scatter_add_(-1, local_idx_c.unsqueeze(-1), label_grad.unsqueeze(-1))


class _ChunkedLinearLogProb(torch.autograd.Function):
    """Log-probs and entropies; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, shard: _Shard):
        n = hidden.shape[0]
        logp, entropy, log_sum_exp = _per_token_buffers(3, hidden)
        local, local_idx = _label_columns(labels, shard.vocab_start, weight.shape[0])
        for a, b in shard.ranges(n):
            e, ez, logp[a:b], entropy[a:b], sum_e, _, z_max = _chunk_forward(
                hidden[a:b], weight, local[a:b], local_idx[a:b], shard
            )
            del e, ez
            log_sum_exp[a:b] = z_max + sum_e.log()
        ctx.save_for_backward(hidden, weight, local_idx, local, log_sum_exp, entropy)
        ctx.shard = shard
        ctx.set_materialize_grads(False)  # entropy is usually only a metric: then no gradient arrives for it
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, local_idx, local, log_sum_exp, entropy = ctx.saved_tensors
        shard = ctx.shard
        if grad_logp is None:
            grad_logp = torch.zeros_like(log_sum_exp)
        grad_hidden = torch.empty_like(hidden)  # each chunk's rows are written once: no accumulation
        grad_weight = torch.zeros_like(weight, dtype=_acc_dtype(weight))
        for a, b in shard.ranges(hidden.shape[0]):
            # shifted by the log-sum-exp, e is p itself (sum e = 1) and E_p[z - lse] = -H
            z = shard.logits(hidden[a:b], weight).sub_(log_sum_exp[a:b].unsqueeze(-1))
            e = torch.exp(z)
            ez = None if grad_entropy is None else z.mul_(e)
            grad_z = _grad_logits(
                e,
                ez,
                1.0,
                -entropy[a:b],
                grad_logp[a:b],
                None if grad_entropy is None else grad_entropy[a:b],
                local[a:b],
                local_idx[a:b],
                shard.inv_temperature,
            )
            del z, ez, e  # grad_z is e's buffer: it goes once its copy in the params' dtype exists
            grad_z = grad_z.to(weight.dtype)
            grad_hidden[a:b] = grad_z @ weight
            _accumulate_mm(grad_weight, grad_z.t(), hidden[a:b])
        return grad_hidden, grad_weight.to(weight.dtype), None, None


@dataclass
class _LossGradState:
    """What the loss-gradient forward reads and fills, chunk by chunk."""

    weight: torch.Tensor  # [V/tp, H] as given: every matmul runs in its dtype
    logp: torch.Tensor
    entropy: torch.Tensor
    grad_hidden: torch.Tensor | None  # [N, H] in hidden's dtype (each chunk rounded once, as in backward)
    grad_weight: torch.Tensor | None  # [V/tp, H] fp32 accumulator


def _logp_grad_step(state: _LossGradState, a, b, hidden_c, local_c, local_idx_c, shard: _Shard, loss_grad):
    """A chunk of a loss without entropy term, in ONE [C, V/tp] buffer and no elementwise gradient pass.

    With dL/dz = g (onehot(y) - p) / T:  d hidden = g (W_y - E_p[W]) / T  and
    d W = p^T (-g hidden / T) + onehot(y)^T (g hidden / T). E_p[W] = e @ W / sum e (e = exp(z - max), made
    in place of z) is d hidden's matmul, and it also gives the entropy: E_p[z] = hidden . E_p[W] / T.
    Both matmuls take e in the params' dtype (a copy: sum e stays that of the fp32 e, so log-probs are those
    of the other paths); the entropy then carries E_p[W]'s rounding to bf16, about that of bf16 logits.
    """
    z = shard.logits(hidden_c, state.weight)
    z_max = z.amax(dim=-1)
    _all_reduce(z_max, shard.tp_group, dist.ReduceOp.MAX)
    target = z.sub_(z_max.unsqueeze(-1)).gather(-1, local_idx_c.unsqueeze(-1)).squeeze(-1) * local_c
    sum_e = z.exp_().sum(dim=-1)  # e = exp(z - max) in z's buffer
    e = z.to(state.weight.dtype)
    del z  # a bf16 model's fp32 e goes once its bf16 copy exists
    hidden_acc = hidden_c.to(sum_e.dtype)
    e_w = (e @ state.weight).to(sum_e.dtype)  # [C, H]: this shard's sum_v e_v W_v
    sums = torch.stack([sum_e, target, (hidden_acc * e_w).sum(dim=-1) * shard.inv_temperature])
    _all_reduce(sums, shard.tp_group)
    sum_e, log_sum_e = sums[0], sums[0].log()
    state.logp[a:b], state.entropy[a:b] = sums[1] - log_sum_e, z_max + log_sum_e - sums[2] / sum_e
    grad_logp, grad_entropy = loss_grad(a, b, state.logp[a:b], state.entropy[a:b])
    if grad_entropy is not None:
        raise ValueError("the loss has an entropy term: use entropy_grad=True")
    scale_p = (grad_logp * (-shard.inv_temperature) / sum_e).unsqueeze(-1)
    scale_label = (grad_logp * local_c * shard.inv_temperature).unsqueeze(-1)
    if state.grad_hidden is not None:
        state.grad_hidden[a:b] = e_w.mul_(scale_p).addcmul_(state.weight[local_idx_c], scale_label)
    if state.grad_weight is not None:
        _accumulate_mm(state.grad_weight, e.t(), (hidden_acc * scale_p).to(e.dtype))
        state.grad_weight.index_add_(0, local_idx_c, hidden_acc * scale_label)


def _logp_entropy_grad_step(state: _LossGradState, a, b, hidden_c, local_c, local_idx_c, shard: _Shard, loss_grad):
    """A chunk of a loss with an entropy term: e and e (z - max) in two [C, V/tp] buffers, dL/dz in e's."""
    e, ez, state.logp[a:b], state.entropy[a:b], sum_e, shifted_mean, _ = _chunk_forward(
        hidden_c, state.weight, local_c, local_idx_c, shard
    )
    grad_logp, grad_entropy = loss_grad(a, b, state.logp[a:b], state.entropy[a:b])
    grad_z = _grad_logits(
        e, ez, 1.0 / sum_e, shifted_mean, grad_logp, grad_entropy, local_c, local_idx_c, shard.inv_temperature
    )
    del e, ez  # grad_z is e's buffer: it goes once its copy in the params' dtype exists
    grad_z = grad_z.to(state.weight.dtype)
    if state.grad_hidden is not None:
        state.grad_hidden[a:b] = grad_z @ state.weight
    if state.grad_weight is not None:
        _accumulate_mm(state.grad_weight, grad_z.t(), hidden_c)


class _ChunkedLinearLogProbLossGrad(torch.autograd.Function):
    """Log-probs, entropies (no gradient flows through them) and a zero scalar whose gradient is the loss's:
    d hidden and d W_shard are accumulated in the forward chunk loop, backward scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, shard: _Shard, loss_grad: LossGradFn, entropy_grad: bool):
        acc = _acc_dtype(hidden)
        state = _LossGradState(
            weight,
            *_per_token_buffers(2, hidden),
            grad_hidden=torch.empty_like(hidden) if ctx.needs_input_grad[0] else None,
            grad_weight=torch.zeros_like(weight, dtype=acc) if ctx.needs_input_grad[1] else None,
        )
        local, local_idx = _label_columns(labels, shard.vocab_start, weight.shape[0])
        step = _logp_entropy_grad_step if entropy_grad else _logp_grad_step
        for a, b in shard.ranges(hidden.shape[0]):
            step(state, a, b, hidden[a:b], local[a:b], local_idx[a:b], shard, loss_grad)
        grad_weight = None if state.grad_weight is None else state.grad_weight.to(weight.dtype)
        ctx.grads = (state.grad_hidden, grad_weight)
        ctx.mark_non_differentiable(state.logp, state.entropy)
        return state.logp, state.entropy, state.logp.new_zeros(())

    @staticmethod
    def backward(ctx, _grad_logp, _grad_entropy, grad_anchor):
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None  # d hidden and d W are handed over (and scaled in place): backward runs once
        if grad_anchor is None:  # the loss did not use the anchor
            return None, None, None, None, None, None
        scale = [g if g is None else g.mul_(grad_anchor.to(g.dtype)) for g in (grad_hidden, grad_weight)]
        return *scale, None, None, None, None


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
    """(log p(labels), entropy) for hidden [N, H] against this rank's vocab shard weight [V/tp, H].

    The matmuls (logits, and in backward d hidden and d W) run in the params' dtype, the softmax in fp32.
    """
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
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log p(labels) [N], entropy [N], anchor []) for a loss L whose gradient is per token.

    `loss_grad(a, b, logp_C, entropy_C)` gives dL/dlogp and dL/dentropy (None: L has no entropy term) of
    tokens a:b, from their (TP-reduced) values alone; it is called once per chunk, in this forward. The
    log-probs and entropies carry no gradient: add `anchor` (a zero) to the loss, times any constant factor
    the loss applies after the per-token sum, and its gradient reaches hidden and weight.
    entropy_grad=False (L has no entropy term) takes the one-buffer path without an elementwise gradient pass.
    The matmuls (logits, d hidden, d W) run in the params' dtype, the softmax and the loss's gradient in fp32.
    """
    shard = _shard(vocab_start, true_vocab, temperature, tp_group, chunk)
    return _ChunkedLinearLogProbLossGrad.apply(hidden, weight, labels, shard, loss_grad, entropy_grad)


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
