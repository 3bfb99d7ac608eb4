"""Engines by name: a missing package is one line naming it and its install command; a failing engine is one
EngineError naming the engine, the call and the cause, chained to the original exception whose traceback is
logged, and its own exit code (3, not bad input's 2); engine settings are checked against the world."""

import importlib.util
import logging
import traceback

import pytest
import torch

from dapo_mcore import cli
from dapo_mcore.cli import main
from dapo_mcore.data.arithmetic import ArithmeticTask
from dapo_mcore.data.datasets import PromptStream
from dapo_mcore.rewards.pool import VerifierPool
from dapo_mcore.rollout import registry
from dapo_mcore.rollout.base import Completion, EngineSettings, SamplingParams
from dapo_mcore.rollout.guard import GuardedEngine
from dapo_mcore.rollout.sampler import RolloutSampler, SamplerSettings
from dapo_mcore.utils.errors import BAD_INPUT_EXIT_CODE, ENGINE_EXIT_CODE, ConfigError, EngineError
from dapo_mcore.utils.timers import PhaseTimer
from tests.conftest import REPO
from tests.helpers import FakeTokenizer, ScriptedEngine
from tests.unit.test_sampler import BASE


def test_a_missing_engine_package_names_the_package_and_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        registry.create_engine("vllm", EngineSettings(model_path="unused"))
    assert str(err.value) == (
        "rollout.engine=vllm needs the 'vllm' package: pip install -c requirements/torch2.11-vllm0.26.txt -e '.[vllm]' "
        "(the tested sets and their second line: docs/gpu.md); a vLLM 0.26 to 0.33 built for your torch; on a "
        "machine without CUDA: make setup"
    )


def test_an_unknown_engine_name_lists_the_engines():
    with pytest.raises(ConfigError, match=r"one of \['hf', 'sglang', 'vllm'\]"):
        registry.create_engine("trt", EngineSettings(model_path="unused"))


class Exploding:
    def generate(self, prompt_ids, params):
        raise RuntimeError("Worker proc VllmWorker-0 died unexpectedly\nshutting down")


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_an_engine_failure_keeps_its_cause_and_logs_its_traceback_once():
    logger, records = logging.getLogger("dapo_mcore.rollout.guard"), Records()
    logger.addHandler(records)
    try:
        with pytest.raises(EngineError) as err:
            GuardedEngine("vllm", Exploding).generate([[1, 2]], SamplingParams(n=2))
    finally:
        logger.removeHandler(records)
    cause = err.value.__cause__
    assert isinstance(cause, RuntimeError) and "died unexpectedly" in str(cause)  # the whole message, kept
    [logged] = [r for r in records.records if r.levelno == logging.ERROR]
    assert logged.exc_info[1] is cause
    text = "".join(traceback.format_exception(*logged.exc_info))
    assert "in generate" in text and "VllmWorker-0 died unexpectedly" in text  # where it was raised, in full


def test_the_cli_exits_3_on_an_engine_failure_and_ends_with_one_line(monkeypatch, capsys):
    def fails_in_the_engine(args):
        GuardedEngine("vllm", Exploding).generate([[1, 2]], SamplingParams(n=2))

    monkeypatch.setattr(cli, "_show_config", fails_in_the_engine)
    code = main(["config", "unused.yaml"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == ENGINE_EXIT_CODE == 3 and BAD_INPUT_EXIT_CODE == 2  # bad input keeps 2
    assert err[-1] == "dapo-mcore: error: rollout engine 'vllm' failed in generate: RuntimeError: shutting down"


def test_an_engine_that_raises_becomes_one_error_naming_engine_call_and_cause():
    engine = GuardedEngine("vllm", Exploding)
    with pytest.raises(EngineError) as err:
        engine.generate([[1, 2]], SamplingParams(n=2))
    assert str(err.value) == "rollout engine 'vllm' failed in generate: RuntimeError: shutting down"
    assert not err.value.same_on_every_rank  # printed by the rank it happened on, not only rank 0


def test_an_engine_that_fails_to_start_stops_the_run_with_one_line(capsys, tmp_path):
    # A KV cache larger than any machine: vLLM refuses at start; the run ends with exit 3 and, after the
    # engine's logged traceback, one line.
    pytest.importorskip("vllm")
    code = main(
        [
            "train",
            str(REPO / "examples/smoke_cpu.yaml"),
            "rollout.engine=vllm",
            "rollout.cpu_kv_cache_mb=100000000",
            f"logging.run_dir={tmp_path / 'run'}",
            "logging.wandb.mode=disabled",
            "logging.plot=false",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3
    assert err[-1].startswith("dapo-mcore: error: rollout engine 'vllm' failed in start:"), err[-3:]
    assert "rollout engine 'vllm' failed in start; the engine's traceback:" in "\n".join(err)


def test_engine_tp_above_one_needs_an_engine_with_tensor_parallelism(capsys, tmp_path):
    code = main(["train", str(REPO / "examples/smoke_cpu.yaml"), "rollout.engine_tp_size=2"])
    assert code == 2
    assert "rollout.engine_tp_size > 1 needs rollout.engine=vllm or sglang" in capsys.readouterr().err


def test_sleep_state_takes_each_released_pool_back_once():
    from dapo_mcore.rollout.base import SleepState

    calls = []
    sleep = SleepState(True, ("weights", "kv_cache"))
    sleep.wake(calls.append)  # nothing released yet: nothing to wake
    sleep.release(lambda: calls.append("release"))
    sleep.release(lambda: calls.append("release"))  # already released
    sleep.wake(calls.append, only=("weights",))  # a push: the weights only
    sleep.wake(calls.append)  # before generating: what is still released
    assert calls == ["release", ["weights"], ["kv_cache"]]
    off = SleepState(False, ("weights",))
    off.release(lambda: calls.append("never"))
    assert "never" not in calls


class Returning:
    """An engine that returns what it is told to (the adapter's raw output: lists)."""

    def __init__(self, completions):
        self.completions = completions

    def generate(self, prompt_ids, params):
        return [self.completions]


def guarded(*completions) -> GuardedEngine:
    return GuardedEngine("fake", lambda: Returning(list(completions)))


def test_engine_outputs_cross_the_guard_as_int32_and_float32_tensors():
    (c,) = guarded(Completion([5, 6, 7], [-0.5, -1.0, -2.0], "stop", "x")).generate([[1, 2]], SamplingParams(n=1))[0]
    assert c.token_ids.dtype == torch.int32 and c.token_ids.tolist() == [5, 6, 7]
    assert c.logprobs.dtype == torch.float32 and c.logprobs.tolist() == [-0.5, -1.0, -2.0]


def test_an_answer_one_log_prob_short_stops_the_run_naming_it():
    """It would shift every later sample of its replica's batch by one token."""
    engine = guarded(Completion([5, 6], [-0.5, -1.0], "stop", "x"), Completion([5, 6, 7], [-0.5, -1.0], "stop", "y"))
    with pytest.raises(EngineError, match=r"'fake' returned 2 log-probs for 3 tokens in answer 1 of prompt 0"):
        engine.generate([[1, 2]], SamplingParams(n=2))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_log_prob_that_is_not_finite_stops_the_run_naming_the_answer_and_token(bad):
    """A NaN weight pushed into the engine shows first in its log-probs: stopped as they arrive, before a loss,
    the mismatch guard's KL or a verifier sees them."""
    engine = guarded(Completion([5, 6], [-0.5, -1.0], "stop", "x"), Completion([5, 6, 7], [-0.5, bad, -1], "stop", "y"))
    with pytest.raises(EngineError, match=rf"'fake' returned a log-prob that is not a finite number \({bad} at token 1 "
                       r"of 3\) in answer 1 of prompt 0"):  # fmt: skip
        engine.generate([[1, 2]], SamplingParams(n=2))


def test_routing_whose_rows_do_not_match_the_tokens_is_dropped_counted_and_logged_once(caplog):
    """Routing replay would raise on it hours into a run (one odd sample: an n > 1 child, a stop string cut):
    the sample keeps its tokens, its routers choose for it, and rollout/routing_dropped counts it."""
    right = torch.zeros(4, 2, 2, dtype=torch.int16)  # prompt 2 + 3 new tokens - 1 rows
    wrong = torch.zeros(7, 2, 2, dtype=torch.int16)
    answers = [Completion([5, 6, 7], [-0.5] * 3, "stop", "x", r) for r in (right, wrong, wrong)]
    with caplog.at_level("WARNING", logger="dapo_mcore"):
        out = guarded(*answers).generate([[1, 2]], SamplingParams(n=3))[0]
    assert out[0].routed_experts.dtype == torch.uint8 and not out[0].routing_dropped
    assert [c.routed_experts is None and c.routing_dropped for c in out[1:]] == [True, True]
    assert caplog.text.count("routing of shape (7, 2, 2) for 4 input positions") == 1
    # the sampler counts it, the same on every rank (from the summaries)
    sampler = RolloutSampler(
        GuardedEngine("fake", lambda: RoutedScripted()),
        FakeTokenizer(),
        PromptStream(ArithmeticTask(0, 9), seed=0),
        VerifierPool("dapo", workers=0).verify,
        SamplerSettings(**BASE),
        rank=0,
        world_size=1,
        all_gather=lambda obj: [obj],
    )
    batch = sampler.next_batch(0, PhaseTimer())
    assert batch.metrics["rollout/routing_dropped"] == batch.metrics["rollout/generated_samples"] / 2


class RoutedScripted(ScriptedEngine):
    """Half right, with routing: the odd answers' routing one row short."""

    def __init__(self):
        super().__init__(lambda text, j: j % 2 == 0)

    def generate(self, prompt_ids, params):
        out = super().generate(prompt_ids, params)
        for ids, group in zip(prompt_ids, out):
            for j, c in enumerate(group):
                rows = len(ids) + len(c.token_ids) - 1 - j % 2
                c.routed_experts = torch.zeros(rows, 1, 2, dtype=torch.uint8)
        return out
