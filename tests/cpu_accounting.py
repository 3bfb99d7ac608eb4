"""Per-test CPU seconds of the suite (opt-in): `make test PYTEST_CPU=1`, or
`pytest -p tests.cpu_accounting ...`, writes one JSON line per test to `$DAPO_TEST_CPU_LOG` (default
<system tmp>/dapo_test_cpu.jsonl): its id, CPU seconds and wall seconds.

On 2 cores the suite is CPU-bound (tests/README.md, "Where it stands"): a test's wall time says more about its
neighbours than about itself. Each pytest-xdist worker moves itself into a cgroup of its own (v1 cpuacct, as
root), which every process it starts inherits: torchrun's ranks, warm CLI servers and their runs, the test Slurm
clusters' daemons and jobs (tests/slurm/cluster.py starts them). A worker runs one test at a time, so the
cgroup's usage between a test's start and end is what that test cost, whichever process spent it. Where no
cgroup can be made (not root, no cpuacct), the process's own and its waited-for children's CPU are counted
(resource.getrusage): torchrun's ranks are, warm runs and Slurm jobs are not.
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
import time
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
_cgroup: Path | None = None


def _log_path() -> Path:
    return Path(os.environ.get("DAPO_TEST_CPU_LOG") or Path(tempfile.gettempdir()) / "dapo_test_cpu.jsonl")


def _join_own_cgroup() -> Path | None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    group = CPUACCT / f"dapo_tests_{os.getpid()}_{worker}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        return None
    return group


def _cpu_seconds() -> float:
    if _cgroup is not None:
        return int((_cgroup / "cpuacct.usage").read_text()) / 1e9
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_configure(config):
    global _cgroup
    _cgroup = _join_own_cgroup()


def pytest_unconfigure(config):
    """Leave the cgroup and remove it (it stays while a process started in it still runs)."""
    if _cgroup is not None:
        try:
            (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
            _cgroup.rmdir()
        except OSError:
            pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _cpu_seconds(), time.time()
    yield
    record = {"id": item.nodeid, "cpu_s": round(_cpu_seconds() - cpu, 2), "wall_s": round(time.time() - wall, 2),
              "cgroup": _cgroup is not None}  # fmt: skip
    with open(_log_path(), "a") as log:
        log.write(json.dumps(record) + "\n")


def summary(path: Path, top: int = 30) -> str:
    """The log's total, its sums by tier and module, and its TOP tests by CPU seconds."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_module: dict[str, float] = {}
    by_tier: dict[str, float] = {}
    for record in records:
        module = record["id"].split("::", 1)[0]
        by_module[module] = by_module.get(module, 0.0) + record["cpu_s"]
        tier = module.split("/")[1] if module.count("/") >= 2 else module
        by_tier[tier] = by_tier.get(tier, 0.0) + record["cpu_s"]
    lines = [f"{len(records)} tests, {sum(by_tier.values()) / 60:.1f} CPU-minutes"]
    lines += [f"  {tier:10s} {seconds:7.0f} s" for tier, seconds in sorted(by_tier.items(), key=lambda kv: -kv[1])]
    lines += [
        f"{seconds:7.0f} s  {module}" for module, seconds in sorted(by_module.items(), key=lambda kv: -kv[1])[:top]
    ]
    slowest = sorted(records, key=lambda record: -record["cpu_s"])[:top]
    lines += [f"{r['cpu_s']:7.1f} s cpu {r['wall_s']:7.1f} s wall  {r['id']}" for r in slowest]
    return "\n".join(lines)


if __name__ == "__main__":  # python -m tests.cpu_accounting [LOG]
    import sys

    print(summary(Path(sys.argv[1]) if len(sys.argv) > 1 else _log_path()))
