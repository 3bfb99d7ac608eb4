"""The suite's per-test CPU log (tests/cpu_accounting.py, `make test PYTEST_CPU=1`) and its summary."""

from __future__ import annotations

import json

from tests import cpu_accounting


def test_the_summary_sums_by_tier_and_module_and_lists_the_costliest_tests_first(tmp_path):
    log = tmp_path / "cpu.jsonl"
    records = [("tests/dist/test_a.py::one", 90.0), ("tests/dist/test_a.py::two", 30.0)]
    records.append(("tests/unit/test_b.py::x", 6.0))
    log.write_text("".join(json.dumps({"id": i, "cpu_s": s, "wall_s": 2 * s}) + "\n" for i, s in records))
    lines = cpu_accounting.summary(log, top=2).splitlines()
    assert lines[0] == "3 tests, 2.1 CPU-minutes"
    assert lines[1].split() == ["dist", "120", "s"] and lines[2].split() == ["unit", "6", "s"]
    assert lines[3].split() == ["120", "s", "tests/dist/test_a.py"]
    assert lines[5].endswith("tests/dist/test_a.py::one") and lines[6].endswith("tests/dist/test_a.py::two")


def test_a_test_process_counts_its_own_cpu_where_no_cgroup_is_made(monkeypatch):
    monkeypatch.setattr(cpu_accounting, "_cgroup", None)
    before = cpu_accounting._cpu_seconds()
    sum(i * i for i in range(2_000_000))  # about 0.1 s of this process's CPU
    assert cpu_accounting._cpu_seconds() > before + 0.02
