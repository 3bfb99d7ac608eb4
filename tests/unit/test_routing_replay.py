"""Routing replay (R3) on a tiny Qwen3-MoE: the engine records the experts its router chose, the actor replays them.

The engine's router is deliberately not the actor's (its weights are perturbed), so that engine and actor route
many tokens differently and the replay has something to change. The reference for "a forward pinned to the
engine's experts" is transformers' own Qwen3-MoE with the actor's weights and its routers forced to the
recorded ids: another implementation than Megatron's, so the test fails if the actor replays the wrong rows,
layers or order.
"""

import dataclasses
import shutil

import pytest
import torch

from dapo_mcore.build import actor_settings, load_policy_chunks, optimizer_settings
from dapo_mcore.config import load_config
from dapo_mcore.config.model_spec import load_hf_config, read_model_spec
from dapo_mcore.data.types import NO_EXPERT, Sample
from dapo_mcore.mcore.actor import build_actor
from dapo_mcore.mcore.moe import AgreementCounts, ReplayedRouting, RouterTarget
from dapo_mcore.parallel import destroy_parallel, init_parallel
from dapo_mcore.rollout.base import EngineSettings, SamplingParams
from dapo_mcore.rollout.hf_engine import HFEngine
from dapo_mcore.utils.errors import ConfigError
from tests.helpers import save_tiny_model

SPARSE_LAYER = 0  # the tiny Qwen3-MoE: layer 0 sparse, layer 1 dense (mlp_only_layers)
MINI_BATCHES = [list(range(0, 6)), list(range(6, 12))]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(the actor's HF model dir, the engine's: the same weights but a perturbed router)."""
    from transformers import AutoModelForCausalLM

    actor_dir = save_tiny_model(tmp_path_factory.mktemp("actor"), "qwen3_moe", seed=1)
    engine_dir = tmp_path_factory.mktemp("engine")
    shutil.copytree(actor_dir, engine_dir, dirs_exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(actor_dir)
    with torch.no_grad():
        router = model.model.layers[SPARSE_LAYER].mlp.gate.weight
        torch.manual_seed(5)
        router.add_(router.std() * torch.randn_like(router))
    model.save_pretrained(engine_dir)
    return actor_dir, engine_dir


@pytest.fixture(scope="module")
def samples(models):
    """12 answers (4 prompts x 3) of the engine, with its routing."""
    engine = HFEngine.create(EngineSettings(str(models[1]), return_routed_experts=True))
    prompts = [[5 + i, 17, 9 + 3 * i, 40, 11 + i][: 3 + i % 3] for i in range(4)]
    out = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=10, seed=7))
    made = []
    for ids, completions in zip(prompts, out):
        for c in completions:
            rows = len(ids) + len(c.token_ids) - 1
            assert c.routed_experts.shape == (rows, 2, 2) and c.routed_experts.dtype == torch.uint8
            assert (c.routed_experts[:, 1] == NO_EXPERT).all() and (c.routed_experts[:, SPARSE_LAYER] < 4).all()
            made.append(Sample(ids, c.token_ids, c.logprobs, c.finish_reason, routed_experts=c.routed_experts))
    return made


def build(model_dir, replay: bool, recompute: str = "none", packing: str = "auto"):
    destroy_parallel()
    ctx = init_parallel(1, 1, "cpu")
    overrides = [f"model.hf_path={model_dir}", "parallel.device=cpu", "model.dtype=float32", "model.init=hf"]
    overrides += ["trainer.micro_batch_size=2", "optimizer.warmup_steps=0", f"model.recompute={recompute}"]
    overrides += [f"trainer.packing={packing}"]  # auto: packed rows on the CPU
    overrides += [f"model.routing_replay={'rollout' if replay else 'off'}"]
    cfg = load_config(None, overrides)
    spec = read_model_spec(load_hf_config(str(model_dir)))
    chunks, _ = load_policy_chunks(cfg, ctx, spec)
    return build_actor(ctx, spec, chunks, optimizer_settings(cfg), actor_settings(cfg, pad_id=0))


def old_logprobs(actor, samples) -> tuple[list[torch.Tensor], dict[str, float]]:
    batches = actor.prepare(samples, MINI_BATCHES)
    metrics = actor.compute_old_logprobs(batches, step=0)
    per_sample = [None] * len(samples)
    for micro in batches.mini_batches:
        for mb in micro:
            for index, row, offset in mb.segments:
                start = offset + len(samples[index].prompt_ids) - 1
                per_sample[index] = mb.old_logprobs[row, start : start + len(samples[index].response_ids)]
    return per_sample, metrics


def hf_logprobs(model_dir, samples, pinned: bool) -> list[torch.Tensor]:
    """transformers' log-probs of each response, its routers pinned to the recorded experts or routing freely."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    router = model.model.layers[SPARSE_LAYER].mlp.gate
    forced = {}

    def pin(module, _inputs, output):
        logits, _scores, _ids = output
        ids = forced["ids"]
        scores = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, ids)
        scores = scores / scores.sum(dim=-1, keepdim=True)  # norm_topk_prob, as the router does
        return logits, scores.to(logits.dtype), ids

    if pinned:
        router.register_forward_hook(pin)
    out = []
    with torch.no_grad():
        for s in samples:
            tokens = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
            forced["ids"] = s.routed_experts[:, SPARSE_LAYER].long()
            logits = model(tokens[:, :-1]).logits[0].float()
            logp = torch.log_softmax(logits, dim=-1)[len(s.prompt_ids) - 1 :]
            out.append(logp.gather(1, tokens[0, len(s.prompt_ids) :, None]).squeeze(1))
    return out


def own_agreement(model_dir, samples) -> float:
    """The share of positions predicting a response token where transformers' own top-k set (actor weights)
    is the engine's: what router/agreement must say with replay off."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    agree = total = 0
    with torch.no_grad():
        for s in samples:
            tokens = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])[:, :-1]
            (logits,) = model(tokens, output_router_logits=True).router_logits  # the one sparse layer
            own = logits.topk(2).indices.sort(-1).values[len(s.prompt_ids) - 1 :]
            engine = s.routed_experts[len(s.prompt_ids) - 1 :, SPARSE_LAYER].long().sort(-1).values
            agree += int((own == engine).all(-1).sum())
            total += len(own)
    return agree / total


def max_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_replayed_old_logprobs_equal_a_forward_pinned_to_the_engines_experts(models, samples):
    pinned = hf_logprobs(models[0], samples, pinned=True)
    free = hf_logprobs(models[0], samples, pinned=False)
    assert max_gap(pinned, free) > 1e-2, "the engine's routing must differ from the actor's for this test to tell"

    replayed, on = old_logprobs(build(models[0], replay=True), samples)
    replayed_unpacked, _ = old_logprobs(build(models[0], replay=True, packing="off"), samples)
    own, off = old_logprobs(build(models[0], replay=False), samples)
    destroy_parallel()
    # Observed: 4e-7 (the dense models' conversion tolerance is the same order). Tolerance 1e-5.
    assert max_gap(replayed, pinned) < 1e-5 and max_gap(replayed_unpacked, pinned) < 1e-5
    assert max_gap(own, free) < 1e-5

    expected = own_agreement(models[0], samples)
    assert 0.2 < expected < 0.95
    assert on["router/agreement"] == 1.0
    assert off["router/agreement"] == pytest.approx(expected, abs=1e-12)
    assert on["router/agreement_unreplayed"] == pytest.approx(expected, abs=1e-12)
    assert on["router/agreement_tokens"] == off["router/agreement_tokens"] == sum(s.response_len for s in samples)


def test_replay_under_full_activation_recompute_gives_the_same_gradients(models, samples):
    """Megatron's full recompute routes each layer again inside backward: the replayed experts must be the same
    as in the forward (the order across pipelined micro-batches: the next test)."""
    for s in samples:
        s.advantage, s.old_logprobs = 1.0 if s.response_len % 2 else -1.0, [-2.0] * s.response_len

    def grads(recompute):
        actor = build(models[0], replay=True, recompute=recompute)
        actor.compute_gradients(samples, MINI_BATCHES[0])
        return torch.cat([p.main_grad.flatten() for chunk in actor.chunks for p in chunk.parameters()])

    plain, recomputed = grads("none"), grads("full")
    destroy_parallel()
    assert plain.abs().sum() > 0
    # Observed: bit-identical. Tolerance 1e-6.
    assert torch.allclose(recomputed, plain, atol=1e-6, rtol=0)


def test_without_recompute_a_router_keeps_only_the_target_of_the_forward_it_serves(models, samples):
    """Three micro-batches in one schedule run: without activation recompute nothing takes a target back, so
    keeping each (as a recompute needs) grew by one [tokens, k] per micro-batch and layer until the mini-batch
    ended; only the last is read. They are kept as the samples' uint8, not int64."""
    for s in samples:
        s.advantage, s.old_logprobs = 1.0 if s.response_len % 2 else -1.0, [-2.0] * s.response_len
    actor = build(models[0], replay=True, packing="off")  # micro_batch_size 2: 3 micro-batches of 6 samples
    held = []
    for hooks in actor.routing.hooks.values():
        for hook in hooks:

            def recording(target, hook=hook, set_target=hook.set_target):
                set_target(target)
                held.append((len(hook.targets), hook.targets[-1].engine_Nk.dtype))

            hook.set_target = recording
    actor.compute_gradients(samples, MINI_BATCHES[0])
    destroy_parallel()
    assert len(held) == 3 and {n for n, _ in held} == {1} and {dtype for _, dtype in held} == {torch.uint8}


def test_a_forward_replays_the_newest_targets_and_a_recompute_inside_backward_the_oldest():
    """With pipelining, micro-batch 2's forward runs before micro-batch 1's backward, whose activation recompute
    routes again: it must take micro-batch 1's experts (the single-stage schedule above cannot show this)."""
    hook = ReplayedRouting(0, replay=True, counts=AgreementCounts(1, torch.device("cpu")))
    first, second, unknown = torch.tensor([[0, 1]]), torch.tensor([[2, 3]]), torch.tensor([[-1, -1]])
    scores = torch.tensor([[0.1, 0.2, 0.3, 0.4]])

    def route() -> list[list[int]]:
        hook.begin_forward()  # as each routing call does (install_router_hook)
        _probs, ids = hook.get_replay_topk(scores, 2, default_compute_topk=lambda s, k, **_: torch.topk(s, k, dim=1))
        return ids.tolist()

    counted = torch.ones(1, dtype=torch.bool)
    hook.set_target(RouterTarget(first, counted))
    hook.set_target(RouterTarget(second, counted))
    assert route() == [[2, 3]]
    recomputed = []

    class Recompute(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            recomputed.append(route())
            return grad

    x = torch.zeros(1, requires_grad=True)
    Recompute.apply(x).sum().backward()
    assert recomputed == [[[0, 1]]] and [t.engine_Nk.tolist() for t in hook.targets] == [[[2, 3]]]
    hook.set_target(RouterTarget(unknown, counted))  # no engine routing for the token: the router's own choice
    assert route() == [[3, 2]]


def test_replay_is_refused_in_one_line_where_it_cannot_run(models, tmp_path):
    from dapo_mcore.build import check_routing_replay
    from dapo_mcore.rollout.base import RoutingUnavailable
    from dapo_mcore.rollout.vllm_engine import _llm_kwargs

    def check(model_dir, engine, device="cpu"):
        cfg = load_config(None, [f"model.hf_path={model_dir}", f"rollout.engine={engine}", f"parallel.device={device}"])
        cfg.model.routing_replay = "rollout"
        check_routing_replay(cfg, read_model_spec(load_hf_config(str(model_dir))))

    check(models[0], "hf")
    check(models[0], "vllm", device="cuda")  # `check` of a GPU run on a login node without one: no device needed
    with pytest.raises(ConfigError, match="has no experts to route"):
        check(save_tiny_model(tmp_path, "qwen3"), "hf")
    with pytest.raises(ConfigError, match="vLLM's CPU build cannot return routed experts"):
        check(models[0], "vllm")
    settings = EngineSettings(str(models[0]), return_routed_experts=True)
    with pytest.raises(RoutingUnavailable, match="Model Runner V2"):
        _llm_kwargs(settings)  # the adapter refuses too, for callers that build it directly
    on_gpu = _llm_kwargs(dataclasses.replace(settings, device="cuda", enable_prefix_caching=False))
    assert on_gpu["enable_return_routed_experts"] and on_gpu["enable_prefix_caching"]


def test_the_engine_is_asked_for_routing_only_for_replay(models):
    """Routing is 48 x 8 bytes a token at 30B-A3B (48 x a token and its log-prob): asked for, moved and held
    only when the actor replays it."""
    from dapo_mcore.build import engine_settings, returns_routing

    spec = read_model_spec(load_hf_config(str(models[0])))
    for replay, asked in (("off", False), ("rollout", True)):
        cfg = load_config(None, [f"model.hf_path={models[0]}", "parallel.device=cpu", f"model.routing_replay={replay}"])
        assert returns_routing(cfg, spec) is asked
    destroy_parallel()
    ctx = init_parallel(1, 1, "cpu")
    assert engine_settings(cfg, ctx, routing=returns_routing(cfg, spec)).return_routed_experts
    destroy_parallel()
