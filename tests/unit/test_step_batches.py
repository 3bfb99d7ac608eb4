"""One RL step's data on the actor: micro-batches built once, old log-probs written into them on the device.

The step path (prepare -> compute_old_logprobs -> train_step) must give what the per-sample path gives
(fill_logprobs into lists, then compute_gradients from the samples), without building any micro-batch twice
and without turning log-probs into Python lists.
"""

import pytest
import torch

import dapo_mcore.mcore.actor as actor_module
from dapo_mcore.build import actor_settings, load_policy_chunks, optimizer_settings
from dapo_mcore.config import load_config
from dapo_mcore.config.model_spec import load_hf_config, read_model_spec
from dapo_mcore.mcore.actor import build_actor
from dapo_mcore.parallel import destroy_parallel, init_parallel
from tests.helpers import random_samples, save_tiny_model


@pytest.fixture(scope="module", params=["off", "mask"])
def actor(request, tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("model"), "llama")
    destroy_parallel()
    ctx = init_parallel(1, 1, "cpu")
    overrides = [f"model.hf_path={model}", "parallel.device=cpu", "model.dtype=float32", "model.init=hf"]
    overrides += ["trainer.micro_batch_size=3", f"trainer.packing={request.param}", "optimizer.warmup_steps=0"]
    cfg = load_config(None, overrides)
    spec = read_model_spec(load_hf_config(str(model)))
    chunks, _ = load_policy_chunks(cfg, ctx, spec)
    yield build_actor(ctx, spec, chunks, optimizer_settings(cfg), actor_settings(cfg, pad_id=0))
    destroy_parallel()


def fresh_samples(step_of=lambda i: 0):
    samples = random_samples(10, seed=3)
    for i, s in enumerate(samples):
        s.old_logprobs, s.policy_step = None, step_of(i)
    return samples


MINI_BATCHES = [list(range(0, 5)), list(range(5, 10))]


def test_old_logprobs_stay_tensors_in_the_micro_batches_and_equal_the_per_sample_path(actor):
    batches = actor.prepare(fresh_samples(), MINI_BATCHES)
    actor.compute_old_logprobs(batches, step=0)
    reference = fresh_samples()
    actor.fill_logprobs(reference, MINI_BATCHES, "old_logprobs")
    assert all(s.old_logprobs is None for s in batches.samples), "the step path wrote lists onto the samples"
    for micro in batches.mini_batches:
        for mb in micro:
            assert isinstance(mb.old_logprobs, torch.Tensor) and mb.old_logprobs.device == actor.ctx.device
            for index, row, offset in mb.segments:
                s = reference[index]
                start = offset + len(s.prompt_ids) - 1
                assert mb.old_logprobs[row, start : start + len(s.response_ids)].tolist() == s.old_logprobs
            assert (mb.old_logprobs[mb.response_mask == 0] == 0).all()


def test_the_update_reads_the_prepared_micro_batches_and_builds_none_again(actor, monkeypatch):
    builds = []
    for name in ("build_micro_batch", "build_packed_micro_batch"):
        real = getattr(actor_module, name)
        monkeypatch.setattr(actor_module, name, lambda *a, _real=real, **k: builds.append(1) or _real(*a, **k))
    batches = actor.prepare(fresh_samples(), MINI_BATCHES)
    n_built = len(builds)
    assert n_built == sum(len(micro) for micro in batches.mini_batches) > 0
    actor.compute_old_logprobs(batches, step=0)
    sums = [actor._gradients(micro) for micro in batches.mini_batches]
    assert len(builds) == n_built, "old log-probs or the update built micro-batches again"
    monkeypatch.undo()
    reference = fresh_samples()
    actor.fill_logprobs(reference, MINI_BATCHES, "old_logprobs")
    expected = [actor.compute_gradients(reference, indices) for indices in MINI_BATCHES]
    for got, want in zip(sums, expected):
        assert torch.equal(got, want)


def test_mismatch_and_offpolicy_metrics_split_tokens_by_the_weights_that_sampled_them(actor):
    samples = fresh_samples(step_of=lambda i: 4 if i % 3 else 3)  # every third sample carried from step 3
    metrics = actor.compute_old_logprobs(actor.prepare(samples, MINI_BATCHES), step=4)
    reference = fresh_samples()
    actor.fill_logprobs(reference, MINI_BATCHES, "old_logprobs")

    def gap(indices):
        diff = torch.cat([torch.tensor(reference[i].old_logprobs) - torch.tensor(reference[i].rollout_logprobs)
                          for i in indices]).double()  # fmt: skip
        return diff.abs().max().item()

    assert metrics["mismatch/abs_logp_diff_max"] == gap([i for i in range(10) if i % 3])
    assert metrics["offpolicy/abs_logp_diff_max"] == gap([i for i in range(10) if i % 3 == 0])
