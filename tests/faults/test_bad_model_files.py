"""A model directory whose files are well formed but hold what no run can use: config.json naming a dtype torch does
not have, weights that are not floating point (quantized, or scaled and rounded to integers). `check` and `train`
each refuse it in one line naming the file and the key or tensor; float weights of another dtype than config.json's
load, with one warning naming both."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from dapo_mcore.checkpoint.hf_io import SafetensorsReader, check_weight_dtypes
from dapo_mcore.utils.errors import CheckpointError
from tests.conftest import REPO
from tests.e2e.test_train_cli import SHORT, cli

MODEL = REPO / "examples/models/tiny-arith"


def model_copy(tmp_path: Path, name: str) -> Path:
    return shutil.copytree(MODEL, tmp_path / name)


def rewrite_weights(model: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    weights = model / "model.safetensors"
    save_file({k: change(w) for k, w in load_file(weights).items()}, weights, metadata={"format": "pt"})


def check(tmp_path: Path, model: Path, expect: int):
    return cli("check", "examples/smoke_cpu.yaml", f"model.hf_path={model}", f"logging.run_dir={tmp_path / 'run'}",
               expect=expect)  # fmt: skip


def train(tmp_path: Path, model: Path, expect: int = 0):
    return cli("train", "examples/smoke_cpu.yaml", *SHORT, "trainer.steps=1", "logging.wandb.mode=disabled",
               "logging.progress=false", f"model.hf_path={model}", f"logging.run_dir={tmp_path / 'run'}",
               expect=expect)  # fmt: skip


def problems(proc) -> list[str]:
    return [line[4:] for line in proc.stderr.splitlines() if line.startswith("  - ")]


def last_line(proc) -> str:
    return proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_a_config_json_naming_an_unknown_dtype_is_one_line_in_check_and_train(tmp_path, key):
    """Both printed `AttributeError: module 'torch' has no attribute 'bfloat99'` as a traceback (transformers'
    config reader), naming neither the file nor the key."""
    model = model_copy(tmp_path, "dtc")
    config = json.loads((model / "config.json").read_text())
    config.pop("dtype")
    (model / "config.json").write_text(json.dumps({**config, key: "bfloat99"}, indent=2))
    line = (f'{model}/config.json: {key} "bfloat99" is not a dtype a model can be read in (allowed: bfloat16, '
            "float16, float32, float64)")  # fmt: skip
    checked = check(tmp_path, model, expect=2)
    assert problems(checked) == [line] and "Traceback" not in checked.stderr
    trained = train(tmp_path, model, expect=2)
    assert last_line(trained) == f"dapo-mcore: error: {line}"
    assert "Traceback" not in trained.stderr and not (tmp_path / "run").exists()


def test_integer_weights_are_refused_in_check_and_train_naming_the_file_and_the_tensor(tmp_path):
    """Weights scaled and rounded to int32 (config.json unchanged): `check` said ready; train cast them to floats
    as they were and ran with accuracy 0, keeping no group for 10 rounds, saved and exited 0."""
    model = model_copy(tmp_path, "dt32")
    rewrite_weights(model, lambda w: (w * 1000).to(torch.int32))
    line = (f"{model}/model.safetensors: tensor 'lm_head.weight' is int32, not a floating-point weight (and 20 more "
            "of the 21 weights): quantized or converted weights cannot be trained (allowed: bfloat16, float16, "
            "float32, float64)")  # fmt: skip
    assert problems(check(tmp_path, model, expect=2)) == [line]
    trained = train(tmp_path, model, expect=2)
    assert last_line(trained) == f"dapo-mcore: error: {line}"
    assert "Traceback" not in trained.stderr and not (tmp_path / "run").exists()
    # the reader itself refuses such a tensor too (the converters read through it)
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'lm_head.weight' is int32, not a float"):
        SafetensorsReader(model).get("lm_head.weight")


def test_float_weights_of_another_dtype_than_config_json_load_with_one_warning(tmp_path):
    model = model_copy(tmp_path, "bf16")
    rewrite_weights(model, lambda w: w.to(torch.bfloat16))  # config.json still says float32
    assert problems(check(tmp_path, model, expect=0)) == []
    trained = train(tmp_path, model)
    warning = (f"{model}: 21 of the 21 weights are bfloat16 (the first: 'lm_head.weight' in model.safetensors), "
               "config.json says float32; they are loaded and cast to model.dtype")  # fmt: skip
    assert trained.stderr.count(warning) == 1


def test_an_integer_buffer_saved_beside_float_weights_is_not_refused(tmp_path):
    """Older checkpoints hold buffers the model does not load (int64 `position_ids`): only weights are judged."""
    from safetensors.torch import load_file, save_file

    model = model_copy(tmp_path, "buffer")
    weights = load_file(model / "model.safetensors")
    save_file({**weights, "model.position_ids": torch.arange(128)}, model / "model.safetensors")
    assert check_weight_dtypes(model, json.loads((model / "config.json").read_text())) is None
