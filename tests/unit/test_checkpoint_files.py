"""Checkpoint bookkeeping that needs no model: metric roll-back, the config checks, the spec check."""

import json
from dataclasses import replace

import pytest

from dapo_mcore.checkpoint.model_checkpoint import check_model_spec, checksum_share
from dapo_mcore.config import load_config, validate
from dapo_mcore.config.model_spec import read_model_spec
from dapo_mcore.utils.errors import CheckpointError, ConfigError
from dapo_mcore.utils.metrics_log import roll_back_metrics
from tests.helpers import tiny_hf_config


def test_roll_back_moves_the_rows_run_again_and_a_row_cut_short(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "x": s}) for s in range(5)]
    path.write_text("\n".join(rows) + '\n{"step": 5, "x"')  # the killed process was writing step 5
    assert roll_back_metrics(path, first_step=3) == 3
    assert path.read_text().splitlines() == rows[:3]
    assert (tmp_path / "metrics.rolled_back.jsonl").read_text().splitlines() == [*rows[3:], '{"step": 5, "x"']
    assert roll_back_metrics(path, first_step=3) == 0 and roll_back_metrics(tmp_path / "none.jsonl", 0) == 0


@pytest.mark.parametrize(
    "override, message",
    [
        ("checkpoint.keep_last=0", "checkpoint.keep_last must be >= 1"),
        ("checkpoint.resume=/no/such/save", "checkpoint.resume=/no/such/save: no such checkpoint directory"),
        ("model.init=mcore", "model.init=mcore needs model.mcore_path"),
        ("checkpoint.save_interval=-1", "checkpoint.save_interval must be >= 0"),
    ],
)
def test_checkpoint_settings_are_checked(override, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config("examples/smoke_cpu.yaml", [override]))


def test_a_checkpoint_of_another_model_names_every_differing_field(tmp_path):
    spec = read_model_spec(tiny_hf_config("qwen2").to_dict())
    saved = vars(replace(spec, num_layers=4, qkv_bias=False))
    with pytest.raises(CheckpointError, match=r"num_layers: checkpoint 4, model.hf_path 2; qkv_bias: checkpoint False"):
        check_model_spec(saved, spec, tmp_path)
    check_model_spec(vars(spec), spec, tmp_path)  # the same model passes


def test_pointing_at_the_checkpoint_directory_instead_of_a_save_is_named(tmp_path):
    from dapo_mcore.checkpoint.model_checkpoint import verify_complete

    (tmp_path / "step_000002").mkdir()
    with pytest.raises(CheckpointError, match="is a directory of saves, not one save: name one of them"):
        verify_complete(tmp_path)
    (tmp_path / "step_000002" / "MANIFEST.json").write_text('["not", "a", "manifest"]')
    with pytest.raises(CheckpointError, match="MANIFEST.json is unreadable"):
        verify_complete(tmp_path / "step_000002")


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8])
def test_every_checksummed_file_is_read_by_exactly_one_rank_and_the_bytes_are_spread(world_size):
    sizes = [7000, 5000, 3000, 3000, 1200, 900, 800, 40, 10, 0]
    files = {f"f{i}": {"bytes": b, "crc32": 1} for i, b in enumerate(sizes)} | {"old": {"bytes": 5, "crc32": None}}
    shares = [checksum_share(files, rank, world_size) for rank in range(world_size)]
    assert sorted(n for share in shares for n in share) == sorted(f"f{i}" for i in range(len(sizes)))
    loads = [sum(files[n]["bytes"] for n in share) for share in shares]
    assert max(loads) - min(loads) <= max(sizes)  # greedy largest-first: within one file of each other
