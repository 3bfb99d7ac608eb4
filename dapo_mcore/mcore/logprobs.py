"""Per-token log-probabilities and entropies from vocab-parallel logits, with an explicit backward.

Each tensor-parallel rank holds a [..., V/tp] slice of the logits. Three all-reduces over the TP group (max,
sum of exponentials, target logit and E_p[z]) give exact full-vocab values without gathering the vocab.
Padded vocab columns (Megatron pads the vocab to a multiple of 128 * TP) are masked out.

Gradients, with z = logits / T and p = softmax(z):
    d logp(y) / dz = onehot(y) - p
    d H / dz       = -p * (z - E_p[z])
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_MASKED = -1e30  # finite, so that p * z stays 0 (not NaN) at masked columns


def _all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    if group is not None:  # None: a single rank holds the whole vocab
        dist.all_reduce(tensor, op=op, group=group)


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_start, true_vocab, inv_temperature, tp_group):
        # fp32 at least (bf16 logits), float64 kept for exactness checks
        z = logits.to(torch.promote_types(logits.dtype, torch.float32)) * inv_temperature
        cols = torch.arange(vocab_start, vocab_start + z.shape[-1], device=z.device)
        z = z.masked_fill(cols >= true_vocab, _MASKED)
        z_max = z.amax(dim=-1)
        _all_reduce(z_max, tp_group, dist.ReduceOp.MAX)
        z = z - z_max.unsqueeze(-1)
        exp_z = z.exp()
        sum_exp = exp_z.sum(dim=-1)
        _all_reduce(sum_exp, tp_group)
        p = exp_z.div_(sum_exp.unsqueeze(-1))
        local = (labels >= vocab_start) & (labels < vocab_start + z.shape[-1])
        local_idx = (labels - vocab_start).clamp(0, z.shape[-1] - 1)
        sums = torch.stack([z.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1) * local, (p * z).sum(dim=-1)])
        _all_reduce(sums, tp_group)
        target_z, expected_z = sums[0], sums[1]
        log_sum_exp = sum_exp.log()
        ctx.save_for_backward(p, z, expected_z, local_idx, local)
        ctx.inv_temperature, ctx.logits_dtype = inv_temperature, logits.dtype
        return target_z - log_sum_exp, log_sum_exp - expected_z

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        p, z, expected_z, local_idx, local = ctx.saved_tensors
        grad_z = -p * (grad_logp.unsqueeze(-1) + grad_entropy.unsqueeze(-1) * (z - expected_z.unsqueeze(-1)))
        grad_z.scatter_add_(-1, local_idx.unsqueeze(-1), (grad_logp * local).unsqueeze(-1))
        return (grad_z * ctx.inv_temperature).to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_start: int,
    true_vocab: int,
    temperature: float = 1.0,
    tp_group=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(labels), entropy) of softmax(logits / temperature) over the full vocab; both shaped like labels.

    `logits` is this rank's [..., V/tp] shard starting at vocab column `vocab_start`; `true_vocab` is the
    tokenizer's vocab size (columns at or past it are padding). tp_group=None means a single rank.
    """
    if tp_group is not None and dist.get_world_size(tp_group) == 1:
        tp_group = None
    return _VocabParallelLogProbEntropy.apply(logits, labels, vocab_start, true_vocab, 1.0 / temperature, tp_group)
