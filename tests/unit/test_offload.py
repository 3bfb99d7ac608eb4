"""rollout.offload_actor: what leaves the device while the engine generates, and that the freed memory is
handed back only once everything has left (PyTorch's cache would otherwise keep it from the engine)."""

import pytest
import torch

import dapo_mcore.mcore.actor as actor_module
from dapo_mcore.build import actor_settings, load_policy_chunks, optimizer_settings
from dapo_mcore.config import load_config
from dapo_mcore.config.model_spec import load_hf_config, read_model_spec
from dapo_mcore.mcore.actor import build_actor, offloadable_state
from dapo_mcore.parallel import destroy_parallel, init_parallel
from tests.helpers import random_samples, save_tiny_model


def adam_over(main_params):
    opt = torch.optim.Adam(main_params, lr=0.1)
    for p in main_params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


def test_adam_moments_and_separate_fp32_main_params_leave_but_not_views_of_the_model():
    model = [torch.nn.Parameter(torch.randn(6, dtype=torch.bfloat16)), torch.nn.Parameter(torch.randn(4))]
    copy_of_bf16 = torch.nn.Parameter(model[0].detach().float().clone())  # a bf16 model's fp32 main param
    view_of_fp32 = torch.nn.Parameter(model[1].detach().view(-1)[:4])  # distributed optimizer, fp32 model
    opt = adam_over([copy_of_bf16, view_of_fp32])
    chosen = {id(holder[key]) for holder, key in offloadable_state(opt, model)}
    moments = [opt.state[p][k] for p in (copy_of_bf16, view_of_fp32) for k in ("exp_avg", "exp_avg_sq")]
    assert {id(m) for m in moments} <= chosen
    assert id(copy_of_bf16) in chosen and id(view_of_fp32) not in chosen
    assert not any(id(opt.state[p]["step"]) in chosen for p in (copy_of_bf16, view_of_fp32))  # stays on the host


@pytest.fixture(scope="module")
def actor(tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("model"), "llama")
    destroy_parallel()
    ctx = init_parallel(1, 1, "cpu")
    cfg = load_config(None, [f"model.hf_path={model}", "parallel.device=cpu", "model.dtype=float32"])
    spec = read_model_spec(load_hf_config(str(model)))
    chunks, _ = load_policy_chunks(cfg, ctx, spec)
    yield build_actor(ctx, spec, chunks, optimizer_settings(cfg), actor_settings(cfg, pad_id=0))
    destroy_parallel()


def test_the_cache_is_emptied_after_the_grad_buffers_and_the_optimizer_state_left(actor, monkeypatch):
    samples = random_samples(4)
    actor.train_step(actor.prepare(samples, [list(range(4))]))  # Adam state exists
    events = []
    monkeypatch.setattr(type(actor), "_on_gpu", property(lambda self: True))  # the GPU's order of calls, on the CPU
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    monkeypatch.setattr(
        actor_module,
        "_moved",
        lambda *args, _real=actor_module._moved, **kw: events.append("moved") or _real(*args, **kw),
    )
    chunk = actor.chunks[0]
    real_offload = chunk.offload_grad_buffers
    monkeypatch.setattr(
        chunk, "offload_grad_buffers", lambda **kw: events.append(("grads", kw["empty_cache"])) or real_offload(**kw)
    )
    actor.offload_for_rollout()
    actor.restore_after_rollout()
    first_empty = events.index("empty_cache")
    assert events[0] == ("grads", False) and "moved" in events[:first_empty]
    assert events.count("empty_cache") == 1 and "moved" in events[first_empty + 1 :]  # the restore moves back
    actor.train_step(actor.prepare(random_samples(4), [list(range(4))]))  # and training goes on
