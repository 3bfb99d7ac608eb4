"""A replica that finishes generating long after the others: the ranks meet on the wait group, whose timeout
(parallel.generation_timeout_minutes) is longer than the default group's (parallel.timeout_minutes)."""

import json
from pathlib import Path

from tests.conftest import run_torchrun


def test_ranks_wait_for_a_slow_replica_longer_than_a_collective_may(tmp_path):
    run_torchrun(Path(__file__).parent / "workers" / "slow_replica.py", 2, str(tmp_path), timeout=120)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    assert rank0["wait_group"] == "ok: r0,r1"
    assert rank0["default_group"].startswith("failed"), "the control did not time out: the test proves nothing"
