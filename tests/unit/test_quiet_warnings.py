"""The warnings every run or save reader used to print that say nothing about it are silenced, and only those:
torch's own deprecation, raised by Megatron-Core's checkpoint loader on every resume, is the case in point."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dapo_mcore.parallel.state import _quiet_benign_warnings
from dapo_mcore.utils.logging import quiet_save_reading


def load_through_the_deprecated_name(save_dir) -> list[warnings.WarningMessage]:
    """What Megatron-Core 0.16's dist_checkpointing loader calls (torch.distributed.checkpoint.load_state_dict)."""
    with warnings.catch_warnings(record=True) as seen:
        dcp.load_state_dict({"w": torch.zeros(2)}, storage_reader=dcp.FileSystemReader(save_dir), no_dist=True)
    return [w for w in seen if issubclass(w.category, FutureWarning)]


@pytest.fixture
def save_dir(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note that it saves in one process
        dcp.save({"w": torch.ones(2)}, checkpoint_id=tmp_path, no_dist=True)
    return tmp_path


def test_the_resumes_deprecation_warning_is_silenced_in_runs_and_save_readers(save_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        (raised,) = load_through_the_deprecated_name(save_dir)  # the real message the filters must match
        assert "`load_state_dict` is deprecated" in str(raised.message)
        with quiet_save_reading():
            assert load_through_the_deprecated_name(save_dir) == []
        _quiet_benign_warnings(on_cpu=True)  # what init_parallel sets for the run
        assert load_through_the_deprecated_name(save_dir) == []


def test_other_future_warnings_still_reach_the_user():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _quiet_benign_warnings(on_cpu=True)
        warnings.warn("a deprecation of the user's own code", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["a deprecation of the user's own code"]
