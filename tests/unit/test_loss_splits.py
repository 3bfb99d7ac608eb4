"""Property: for every aggregation mode, the gradient of a mini-batch equals the sum of its micro-batches'
gradients divided by the summed denominators (what Megatron's calculate_per_token_loss computes)."""

import torch
from hypothesis import assume, given, settings

from tests.loss_properties import loss_batches, part_gradient, whole_gradient


@settings(max_examples=120, deadline=None)
@given(loss_batches())
def test_gradient_is_independent_of_the_micro_batch_split(case):
    batch, loss_settings, parts = case
    total_grad, total_den = torch.zeros_like(batch["logp"]), 0.0
    for part in sorted(set(parts)):
        grad, den = part_gradient(batch, loss_settings, [i for i, p in enumerate(parts) if p == part])
        total_grad, total_den = total_grad + grad, total_den + den
    assume(total_den > 0)  # every loss token masked (a rollout correction): the actor skips that update
    torch.testing.assert_close(total_grad / total_den, whole_gradient(batch, loss_settings), rtol=1e-10, atol=1e-12)
