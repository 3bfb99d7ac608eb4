"""The synthetic engine (rollout.engine=synthetic, rehearsals and tests only): lengths with the configured mean,
growing with the step, cut at the cap; the trainer's token, log-prob and routing shapes; a stopped round's
answers continued to the lengths they were drawn with; the same seeds and step giving the same answers; and
verdicts that make dynamic sampling keep some groups and drop others through the real sampler and filter."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dapo_mcore.config import load_config
from dapo_mcore.config.key_docs import key_descriptions
from dapo_mcore.config.validate import config_problems
from dapo_mcore.data.arithmetic import ArithmeticTask
from dapo_mcore.data.datasets import PromptStream
from dapo_mcore.data.types import NO_EXPERT, ROUTING_DTYPE
from dapo_mcore.rewards.pool import VerifierPool
from dapo_mcore.rewards.synthetic_rule import is_correct, verdict_text
from dapo_mcore.rollout import registry
from dapo_mcore.rollout.base import AnswerRequest, EngineSettings, SamplingParams
from dapo_mcore.rollout.guard import GuardedEngine
from dapo_mcore.rollout.sampler import RolloutSampler, SamplerSettings
from dapo_mcore.rollout.synthetic_engine import HEAD_TOKENS, MoERouting, SyntheticEngine, SyntheticSettings
from dapo_mcore.utils.errors import CheckpointError
from dapo_mcore.utils.timers import PhaseTimer
from tests.helpers import FakeTokenizer

REPO = Path(__file__).resolve().parents[2]
EOS = 2
VOCAB = [i for i in range(3, 100)]  # the tiny models' ids without <pad> <s> </s>


def engine(routing: MoERouting | None = None, **knobs) -> SyntheticEngine:
    return SyntheticEngine(VOCAB, EOS, SyntheticSettings(**knobs), routing)


def answers(eng, n_prompts: int, n: int = 16, cap: int = 100_000, seed: int = 0):
    """Every completion of n answers to each of n_prompts distinct prompts, through the engine guard."""
    guarded = GuardedEngine("synthetic", lambda: eng)
    prompts = [[1, 3 + i % 90, 3 + i // 90, 5] for i in range(n_prompts)]
    return [c for group in guarded.generate(prompts, SamplingParams(n=n, max_new_tokens=cap, seed=seed)) for c in group]


def lognormal_tail(mean: float, sigma: float, cap: int) -> float:
    """P(length > cap) of a lognormal with this mean and log-sigma."""
    z = (math.log(cap) - (math.log(mean) - sigma**2 / 2)) / sigma
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_lengths_have_the_configured_mean_and_it_grows_with_the_step():
    eng = engine(mean_len_first=200, mean_len_last=800, steps=11)
    means = []
    for step in (0, 5, 10, 20):
        eng.step = step
        lengths = [len(c.token_ids) for c in answers(eng, 250)]  # 4,000 answers: the mean's error is ~1.5%
        means.append(sum(lengths) / len(lengths))
    assert means[0] == pytest.approx(200, rel=0.05)
    assert means[1] == pytest.approx(500, rel=0.05)  # half-way: linear in the step
    assert means[2] == pytest.approx(800, rel=0.05)  # the last step (trainer.steps - 1)
    assert means[3] == pytest.approx(means[2], rel=1e-9)  # and no further: the same draws
    assert means[0] < means[1] < means[2]


def test_answers_past_the_cap_are_cut_there_with_finish_reason_length_the_others_end_with_eos():
    eng = engine(mean_len_first=300, mean_len_last=300, length_sigma=0.8)
    done = answers(eng, 250, cap=600)
    cut = [c for c in done if c.finish_reason == "length"]
    assert len(cut) / len(done) == pytest.approx(lognormal_tail(300, 0.8, 600), abs=0.02)  # 10.3%, se 0.5%
    assert {c.finish_reason for c in done} == {"stop", "length"}
    for c in done:
        tokens = c.token_ids.tolist()
        assert set(tokens[:-1]) <= set(VOCAB)  # no special or end-of-sequence id inside an answer
        if c.finish_reason == "length":
            assert len(tokens) == 600 and tokens[-1] in VOCAB
        else:
            assert tokens[-1] == EOS and len(tokens) <= 600
    # a truncated answer is wrong (truncated_wrong); the text ends with the verdict the reward rule reads
    assert not any(is_correct(c.text, "unused") for c in cut)
    assert all(c.text.endswith((verdict_text(True), verdict_text(False))) for c in done)


def test_token_ids_and_logprobs_have_the_trainers_dtypes_and_plausible_values():
    done = answers(engine(mean_len_first=50, mean_len_last=50), 20)
    logprobs = torch.cat([c.logprobs for c in done])
    for c in done:
        assert c.token_ids.dtype == torch.int32 and c.logprobs.dtype == torch.float32
        assert c.token_ids.dim() == 1 and c.logprobs.shape == c.token_ids.shape
        assert c.routed_experts is None  # not asked for
    assert bool((logprobs <= 0).all()) and bool((logprobs > -30).all())
    assert logprobs.mean().item() == pytest.approx(-0.35, abs=0.03)


def test_moe_routing_has_the_hf_engines_rows_layers_and_topk_through_the_registry():
    settings = EngineSettings(model_path=str(REPO / "examples/models/tiny-arith-moe"), return_routed_experts=True)
    eng = registry.create_engine("synthetic", settings, SyntheticSettings(mean_len_first=20, mean_len_last=20))
    prompt = [1, 7, 8, 9, 10]
    [group] = eng.generate([prompt], SamplingParams(n=4, max_new_tokens=32, seed=1))
    for c in group:
        routed = c.routed_experts
        assert not c.routing_dropped  # the guard found its rows match the tokens
        assert routed.dtype == ROUTING_DTYPE and tuple(routed.shape) == (len(prompt) + len(c.token_ids) - 1, 2, 2)
        assert int(routed.max()) < 8  # the model's 8 experts
        assert bool((routed[..., 0] != routed[..., 1]).all())  # top-2 distinct experts per token and layer
        assert torch.equal(routed[: len(prompt)], group[0].routed_experts[: len(prompt)])  # the same prefill
        assert set(c.token_ids[:-1].tolist()).isdisjoint({0, 1, 2})  # <pad>, <s>, </s> never inside
    assert not torch.equal(group[0].routed_experts[len(prompt) :][:5], group[1].routed_experts[len(prompt) :][:5])


def test_dense_layers_of_a_moe_model_route_to_no_expert():
    routing = MoERouting(num_layers=4, sparse_layers=(1, 3), num_experts=64, topk=8)
    [c] = answers(engine(routing, mean_len_first=30, mean_len_last=30), 1, n=1)
    routed = c.routed_experts
    assert tuple(routed.shape) == (4 + len(c.token_ids) - 1, 4, 8)
    assert bool((routed[:, [0, 2]] == NO_EXPERT).all()) and int(routed[:, [1, 3]].max()) < 64
    assert all(len(set(row)) == 8 for row in routed[:, 1].tolist())  # 8 distinct experts a token


def requests_of(prompts, n, cap, seed=0):
    return [AnswerRequest(p, cap, seed + i) for i, p in enumerate(p for p in prompts for _ in range(n))]


def never(i, completion):
    return False


def test_a_round_stopped_part_way_is_continued_token_for_token_to_the_drawn_lengths():
    eng = engine(mean_len_first=40, mean_len_last=40)
    requests = requests_of([[1, 5, 6], [1, 7, 8]], 8, cap=200)
    whole = eng.generate_answers(requests, SamplingParams(n=1), never)

    told = []
    stopped = eng.generate_answers(requests, SamplingParams(n=1), lambda i, c: told.append(i) or len(told) == 3)
    t = len(stopped[told[-1]].token_ids)  # the step at which the third answer ended stopped the round
    assert t >= HEAD_TOKENS
    unfinished = [i for i, c in enumerate(stopped) if c.finish_reason == "abort"]
    assert unfinished and len(told) == 3
    for i, c in enumerate(stopped):
        if c.finish_reason == "abort":  # exactly the tokens of the decode steps so far
            assert len(c.token_ids) == t and torch.equal(c.token_ids, whole[i].token_ids[:t])
            assert len(whole[i].token_ids) > t and c.routed_experts is None
        else:  # ended at or before that step, as in the whole round
            assert torch.equal(c.token_ids, whole[i].token_ids) and c.text == whole[i].text

    # the next round continues them (other seeds: the answer is known by its prompt and first tokens)
    again = [
        AnswerRequest(requests[i].prompt_ids, 200 - t, 1000 + i, tuple(stopped[i].token_ids.tolist()))
        for i in unfinished
    ]
    continued = eng.generate_answers(again, SamplingParams(n=1), never)
    for i, c in zip(unfinished, continued):
        assert torch.equal(torch.cat([stopped[i].token_ids, c.token_ids]), whole[i].token_ids)
        assert torch.equal(torch.cat([stopped[i].logprobs, c.logprobs]), whole[i].logprobs)
        assert c.finish_reason == whole[i].finish_reason and c.text == whole[i].text  # same verdict


class StopAtStep:
    """on_finished whose poll() stops the round at a given decode step (another replica's news)."""

    def __init__(self, step: int):
        self.step, self.polls = step, 0

    def __call__(self, i, completion):
        return False

    def poll(self) -> bool:
        self.polls += 1
        return self.polls >= self.step


@pytest.mark.parametrize("step, stops_at", [(7, 7), (1, HEAD_TOKENS)])
def test_a_poll_stops_the_round_at_its_step_but_not_before_every_answer_has_its_head(step, stops_at):
    eng = engine(mean_len_first=60, mean_len_last=60, length_sigma=0.1)  # every answer longer than 7 tokens
    out = eng.generate_answers(requests_of([[1, 5, 6]], 8, cap=200), SamplingParams(n=1), StopAtStep(step))
    assert [c.finish_reason for c in out] == ["abort"] * 8
    assert [len(c.token_ids) for c in out] == [stops_at] * 8


def test_the_same_seeds_and_step_give_the_same_answers_another_seed_or_step_others():
    def drawn(eng, seed=0):
        return [(c.token_ids.tolist(), c.logprobs.tolist(), c.text) for c in answers(eng, 4, n=4, seed=seed)]

    knobs = dict(mean_len_first=50, mean_len_last=500, steps=10)
    first = drawn(engine(**knobs))
    assert drawn(engine(**knobs)) == first
    assert drawn(engine(**knobs), seed=1) != first  # the request seeds (rollout.seed, step, round)
    assert drawn(engine(**knobs, seed=1)) != first  # rollout.synthetic.seed
    later = engine(**knobs)
    later.step = 3
    assert [len(t) for t, _, _ in drawn(later)] != [len(t) for t, _, _ in first]


def test_weight_pushes_are_checked_and_dropped_and_count_the_steps():
    eng = SyntheticEngine(VOCAB, EOS, SyntheticSettings(), weight_shapes={"w": (2, 3)})
    taken = []

    def weights():
        taken.append("w")
        yield "w", torch.zeros(2, 3)

    for expected_step in (0, 1, 2):  # the push before the first step, then one after each update
        eng.update_weights(weights())
        assert eng.step == expected_step
    assert taken == ["w"] * 3  # every tensor read (the export gathers them as they are read)
    with pytest.raises(CheckpointError, match="'w' has shape"):
        eng.update_weights([("w", torch.zeros(3, 2))])
    with pytest.raises(CheckpointError, match="no parameter named 'v'"):
        eng.update_weights([("v", torch.zeros(1))])
    eng.release_memory()  # no-ops
    eng.resume_memory()
    eng.shutdown()


def sampler_over(eng, **overrides) -> RolloutSampler:
    settings = dict(
        n_samples_per_prompt=8,
        prompts_per_step=16,
        gen_prompts_per_round=32,
        temperature=1.0,
        top_p=1.0,
        max_response_len=64,
        seed=0,
        overlong_buffer_len=8,
    )
    return RolloutSampler(
        GuardedEngine("synthetic", lambda: eng),
        FakeTokenizer(),
        PromptStream(ArithmeticTask(0, 99), seed=0),
        VerifierPool("synthetic", workers=0).verify,
        SamplerSettings(**{**settings, **overrides}),
        rank=0,
        world_size=1,
        all_gather=lambda obj: [obj],
    )


def test_the_solve_rate_makes_dynamic_sampling_keep_some_groups_and_drop_all_right_and_all_wrong_ones():
    eng = engine(mean_len_first=20, mean_len_last=20, solve_rate=0.5, solve_concentration=1.0)
    batch = sampler_over(eng).next_batch(0, PhaseTimer())
    m = batch.metrics
    assert len(batch.groups) == 16 and all(0 < g.accuracy < 1 for g in batch.groups)
    assert m["dynamic_sampling/all_correct_groups"] > 0 and m["dynamic_sampling/all_wrong_groups"] > 0
    assert m["rollout/accuracy"] == pytest.approx(0.5, abs=0.15)
    # a concentrated Beta: prompts near the rate, almost every group mixed
    tight = sampler_over(engine(mean_len_first=20, mean_len_last=20, solve_concentration=200.0))
    m = tight.next_batch(0, PhaseTimer()).metrics
    assert m["dynamic_sampling/all_correct_groups"] + m["dynamic_sampling/all_wrong_groups"] <= 1
    # no prompt ever solved: every group dropped, the round cap reached
    never_solved = sampler_over(engine(mean_len_first=20, mean_len_last=20, solve_rate=0.0), max_rounds=2)
    m = never_solved.next_batch(0, PhaseTimer()).metrics
    assert m["dynamic_sampling/kept_groups"] == 0 and m["dynamic_sampling/cap_hit"] == 1


def test_partial_rollout_through_the_sampler_continues_unfinished_answers_at_the_next_step():
    eng = engine(mean_len_first=30, mean_len_last=30, length_sigma=1.0)
    s = sampler_over(eng, partial_rollout=True, partial_oversample=2.0, max_response_len=256)
    first = s.next_batch(0, PhaseTimer())
    assert len(first.groups) == 16 and s.pending.own  # the round stopped with answers under way
    eng.step = 1
    second = s.next_batch(1, PhaseTimer())
    assert second.metrics["rollout/continued_answers"] > 0
    for g in second.groups:
        for smp in g.samples:
            assert smp.finished and len(smp.rollout_logprobs) == len(smp.response_ids)


def test_the_reward_rule_reads_only_the_synthetic_verdict():
    assert is_correct("(synthetic answer of 9 tokens) " + verdict_text(True), "42")
    assert not is_correct("(synthetic answer of 9 tokens) " + verdict_text(False), "42")
    assert not is_correct("The answer is 42. Answer: 42", "42")  # any other engine's text is wrong


def synthetic_config(*overrides: str):
    return load_config(REPO / "examples/smoke_cpu.yaml", list(overrides))


def test_the_config_takes_the_synthetic_engine_with_its_rule_and_the_guard_off():
    ok = ["rollout.engine=synthetic", "algorithm.reward.verifier=synthetic", "algorithm.mismatch.guard=off"]
    assert config_problems(synthetic_config(*ok, "rollout.synthetic.solve_rate=0.3")) == []
    [problem] = config_problems(synthetic_config("rollout.engine=synthetic", "algorithm.mismatch.guard=off"))
    assert "needs algorithm.reward.verifier=synthetic" in problem
    [problem] = config_problems(synthetic_config("rollout.engine=synthetic", "algorithm.reward.verifier=synthetic"))
    assert "algorithm.mismatch.guard=off" in problem
    [problem] = config_problems(synthetic_config("algorithm.reward.verifier=synthetic"))
    assert "rollout.engine=synthetic only" in problem
    for bad in ("solve_rate=1.5", "solve_concentration=0", "length_sigma=-1", "mean_len_last=0"):
        [problem] = config_problems(synthetic_config(*ok, f"rollout.synthetic.{bad}"))
        assert "rollout.synthetic" in problem and bad.split("=")[0] in problem
    assert registry.engine_problem("synthetic", "cpu", {}) is None


def test_every_synthetic_knob_has_a_description_and_reaches_the_settings():
    cfg = synthetic_config("rollout.synthetic.mean_len_first=10", "rollout.synthetic.seed=3", "trainer.steps=7")
    keys = [k for k in key_descriptions() if k.startswith("rollout.synthetic.")]
    assert len(keys) == 7
    settings = SyntheticSettings.of(cfg.rollout.synthetic, cfg.trainer.steps)
    assert (settings.mean_len_first, settings.seed, settings.steps) == (10, 3, 7)
    assert {k.removeprefix("rollout.synthetic.") for k in keys} | {"steps"} == set(SyntheticSettings.__annotations__)
