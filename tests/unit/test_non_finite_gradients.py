"""A non-finite gradient stops the run before its update: Megatron's optimizer (no loss scaler in fp32/bf16)
steps on a NaN norm and writes NaN weights, which the push hands to the engine (the MoE recipe's
first step under full recompute did exactly that, and only step 2's mismatch guard stopped it)."""

import math

import pytest
import torch

from dapo_mcore.mcore.sharding import unwrap
from dapo_mcore.utils.errors import NonFiniteGradients
from tests.helpers import random_samples
from tests.unit.test_offload import actor  # noqa: F401 (its module fixture: the same tiny actor, built once)


def weights(policy) -> list[torch.Tensor]:
    return [p.detach().clone() for chunk in policy.chunks for p in chunk.parameters()]


@pytest.mark.parametrize("planted", [math.nan, math.inf])
def test_a_planted_non_finite_gradient_stops_the_step_before_its_update_naming_the_parameter(actor, planted):  # noqa: F811
    named = dict(unwrap(actor.chunks[0]).named_parameters())
    name = next(n for n in named if "layers.1." in n and n.endswith("linear_fc2.weight"))
    hook = named[name].register_hook(lambda grad: grad * planted)
    before = weights(actor)
    try:
        with pytest.raises(NonFiniteGradients) as raised:
            actor.train_step(actor.prepare(random_samples(4), [list(range(4))]), step=7)
    finally:
        hook.remove()
    message = str(raised.value)
    assert message.startswith("step 7, update 1: gradients that are not finite (NaN or inf) in 1 parameter tensors")
    assert f"e.g. {name} (rank 0)" in message and "\n" not in message
    assert all(torch.equal(a, b) for a, b in zip(before, weights(actor)))  # no weight written
    metrics = actor.train_step(actor.prepare(random_samples(4), [list(range(4))]), step=8)  # and a clean one steps
    assert math.isfinite(metrics["actor/grad_norm"]) and metrics["actor/updates"] == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, weights(actor)))
