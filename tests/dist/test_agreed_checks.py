"""launch.agreed: a check that one rank alone fails stops every rank with the same error, where the others went on
into the next collective and died there with a transport error (tests/faults/test_resume_agreement.py has it
through the command line)."""

import json
from pathlib import Path

from tests.conftest import run_torchrun


def test_a_check_one_rank_fails_raises_the_same_error_on_every_rank(tmp_path):
    run_torchrun(Path(__file__).parent / "workers" / "agreed_checks.py", 2, str(tmp_path), timeout=120)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["none"] == {"returned": "ok on 0"} and rank1["none"] == {"returned": "ok on 1"}
    # the refusing rank's error, on both, printed once (same_on_every_rank) and with its exit code
    refused = {"class": "CheckpointError", "message": "the file of replica 1 is missing", "same_on_every_rank": True,
               "exit_code": 2}  # fmt: skip
    assert rank0["rank_1_refuses"] == rank1["rank_1_refuses"] == refused
    # two ranks refusing for reasons of their own: the first rank's reason on both
    first = {"class": "ConfigError", "message": "rank 0's reason", "same_on_every_rank": True, "exit_code": 2}
    assert rank0["both_refuse_otherwise"] == rank1["both_refuse_otherwise"] == first
    # not a refusal (a bug): its own traceback on its rank, a line naming it on the others
    assert rank1["rank_1_fails"]["class"] == "ValueError"
    assert rank0["rank_1_fails"] == {
        "class": "PeerFailed",
        "message": "rank 1 failed: ValueError: a bug over two lines (its traceback is in its output)",
        "same_on_every_rank": False,
        "exit_code": 1,
    }
    # a class the other rank cannot unpickle: its message and exit code
    assert rank0["a_local_class"]["class"] == "LocalError" and rank1["a_local_class"]["class"] == "DapoError"
    assert all(
        r["a_local_class"]["message"] == "local" and r["a_local_class"]["exit_code"] == 5 for r in (rank0, rank1)
    )
