"""Worker (2 gloo ranks under torchrun): hypothesis draws the same examples on both ranks (derandomized);
each rank takes the rows the example assigns to it (part % 2), computes its numerator's gradient and its
denominator, all-reduces both, and checks the result against the whole mini-batch's gradient."""

import torch
import torch.distributed as dist
from hypothesis import assume, given, settings

from tests.loss_properties import loss_batches, part_gradient, whole_gradient

INFORMATIVE = []  # examples where the ranks hold different token counts: a wrong normalisation shows there


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(loss_batches())
def check_dp_split(case):
    batch, loss_settings, parts = case
    rank = dist.get_rank()
    rows = [[i for i, p in enumerate(parts) if p % 2 == r] for r in (0, 1)]
    tokens = [batch["mask"][r].sum().item() if r else 0.0 for r in rows]
    grad, den = part_gradient(batch, loss_settings, rows[rank])
    den = den.reshape(1).clone()
    dist.all_reduce(grad)
    dist.all_reduce(den)
    # Both ranks hold the same reduced values, so both pass or both fail (and shrink) in step.
    assume(den.item() > 0)  # every loss token masked (a rollout correction): the actor skips that update
    INFORMATIVE.append(min(tokens) > 0 and tokens[0] != tokens[1])
    torch.testing.assert_close(grad / den, whole_gradient(batch, loss_settings), rtol=1e-10, atol=1e-12)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    check_dp_split()
    assert sum(INFORMATIVE) >= 20, f"only {sum(INFORMATIVE)} informative examples: the property cannot fail"
    dist.destroy_process_group()
