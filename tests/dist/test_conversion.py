"""The conversion tools as a user runs them: HF -> mcore -> HF bit for bit, and check_conversion at TP=1 and 2."""

import pytest
import torch

from tests.conftest import REPO
from tests.helpers import save_tiny_model
from tests.warm_cli import cli_env, run_warm

# (family, tied embeddings, dtype of the HF checkpoint)
FAMILIES = [
    ("llama", False, torch.float32),
    ("llama3", False, torch.float32),
    ("qwen2", False, torch.float32),
    ("qwen3", True, torch.bfloat16),
    ("qwen3_moe", False, torch.float32),  # 4 experts, top-2, layer 1 dense (tests/helpers.py)
]


def tool(name, *args, expect=0):
    """`python tools/NAME ARGS`, forked from the tests' warm server (tests/warm_cli.py)."""
    proc = run_warm(args, cli_env(), 600, script=REPO / "tools" / name)
    assert proc.returncode == expect, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def all_tensors(hf_dir):
    from safetensors.torch import load_file

    tensors = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


@pytest.fixture(scope="module")
def converted(request, tmp_path_factory) -> dict:
    """Each family's tiny HF model converted to mcore, and check_conversion at TP=1 and at TP=2 run once over
    all of them (one run each: the start-up is paid once): {family: (hf_dir, mcore_dir)}, and "tp1" / "tp2":
    the tool's output. Only the families of the tests selected (tests/dist/test_mcore_window.py selects some)."""
    selected = {item.callspec.id for item in request.session.items if item.module is request.module
                and hasattr(item, "callspec")}  # fmt: skip
    families = [(family, tie, dtype) for family, tie, dtype in FAMILIES if family in selected]
    out = {}
    for family, tie, dtype in families:
        tmp = tmp_path_factory.mktemp(family)
        hf = save_tiny_model(tmp / "hf", family, tie=tie, dtype=dtype)  # converted at config.json's dtype
        tool("convert_hf_to_mcore.py", hf, tmp / "mcore")
        out[family] = (hf, tmp / "mcore")
    pairs = [str(path) for family, _, _ in families for path in out[family]]
    out["tp1"] = tool("check_conversion.py", *pairs, "--tp", 1).stdout
    out["tp2"] = tool("check_conversion.py", *pairs, "--tp", 2).stdout
    return out


@pytest.mark.parametrize("family, tie, dtype", FAMILIES, ids=[f for f, _, _ in FAMILIES])
def test_hf_to_mcore_to_hf_is_bit_identical_and_check_conversion_passes_at_tp1_and_tp2(converted, family, tie, dtype):
    from transformers import AutoModelForCausalLM

    hf, mcore = converted[family]
    back = mcore.with_name("back")
    tool("convert_mcore_to_hf.py", mcore, back)
    original, returned = all_tensors(hf), all_tensors(back)
    assert set(returned) == set(original)
    for name, tensor in original.items():
        assert returned[name].dtype == dtype and torch.equal(returned[name], tensor), name
    assert type(AutoModelForCausalLM.from_pretrained(back)).__name__.lower().startswith(family[:5])
    assert f"{mcore}: PASS at TP=1" in converted["tp1"], converted["tp1"]
    assert f"{mcore}: PASS at TP=2" in converted["tp2"], converted["tp2"]


def test_check_conversion_fails_on_other_weights_and_names_a_config_mismatch(tmp_path):
    tool("convert_hf_to_mcore.py", save_tiny_model(tmp_path / "a", "qwen2", seed=0), tmp_path / "mcore")
    proc = tool("check_conversion.py", save_tiny_model(tmp_path / "b", "qwen2", seed=1), tmp_path / "mcore", expect=1)
    assert "FAIL at TP=1" in proc.stdout
    proc = tool("check_conversion.py", save_tiny_model(tmp_path / "c", "llama"), tmp_path / "mcore", expect=2)
    assert "qkv_bias: checkpoint True" in proc.stderr and "False" in proc.stderr and "Traceback" not in proc.stderr
    proc = tool("check_conversion.py", tmp_path / "a", tmp_path / "mcore", tmp_path / "c", expect=2)
    assert "give HF_DIR CKPT_DIR pairs: 3 folders given" in proc.stderr
