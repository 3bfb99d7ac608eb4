"""GPU tier: the CUDA, Transformer Engine and FP8 paths. Every test here is skipped without CUDA (see
tests/conftest.py); the TE and FP8 ones also without transformer_engine.

The parity tests reuse the dist worker (tests/dist/workers/actor_grads.py) with --device cuda.
"""

from pathlib import Path

import pytest
import torch

from dapo_mcore.mcore.provider import transformer_engine_available
from tests.conftest import run_torchrun
from tests.helpers import save_tiny_model

WORKER = Path(__file__).parents[1] / "dist" / "workers" / "actor_grads.py"
needs_te = pytest.mark.skipif(not transformer_engine_available(), reason="needs transformer_engine")


def run(hf_dir: Path, out: Path, *args: str) -> dict:
    # the CPU-mode reference runs with the GPU hidden: CPU mode refuses a machine with a visible GPU
    env = None if "cuda" in args else {"CUDA_VISIBLE_DEVICES": ""}
    run_torchrun(WORKER, 1, str(hf_dir), str(out), *args, env=env)
    return torch.load(out, map_location="cpu")


def max_grad_diff(a: dict, b: dict, run: str = "token-mean/4/0") -> float:
    return max(
        (a["runs"][run]["grads"][k] - b["runs"][run]["grads"][k]).abs().max().item() for k in a["runs"][run]["grads"]
    )


def max_logprob_diff(a: dict, b: dict) -> float:
    return max(max(abs(x - y) for x, y in zip(p, q)) for p, q in zip(a["logprobs"], b["logprobs"]))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("gpu") / "hf", "llama", layers=2)


def test_fused_logprobs_in_bf16_on_cuda_match_fp32(tmp_path):
    from dapo_mcore.mcore.fused_logprobs import chunked_logprobs

    torch.manual_seed(0)
    hidden = torch.randn(4096, 512, device="cuda") * 0.5
    weight = torch.randn(32000, 512, device="cuda") * 0.02
    labels = torch.randint(0, 32000, (4096,), device="cuda")
    ref_logp, ref_ent = chunked_logprobs(hidden, weight, labels, vocab_start=0, true_vocab=32000)
    logp, ent = chunked_logprobs(hidden.bfloat16(), weight.bfloat16(), labels, vocab_start=0, true_vocab=32000)
    assert logp.dtype == torch.float32  # reductions in fp32 whatever the matmul dtype
    torch.testing.assert_close(logp, ref_logp, rtol=0, atol=0.05)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=0.05)


def test_actor_on_cuda_matches_the_cpu_mode_in_fp32(hf_dir, tmp_path):
    cpu = run(hf_dir, tmp_path / "cpu.pt")
    cuda = run(hf_dir, tmp_path / "cuda.pt", "--device", "cuda")
    assert max_logprob_diff(cpu, cuda) < 1e-4 and max_grad_diff(cpu, cuda) < 1e-5


@needs_te
def test_transformer_engine_layers_match_the_local_spec(hf_dir, tmp_path):
    local = run(hf_dir, tmp_path / "local.pt", "--device", "cuda")
    te = run(hf_dir, tmp_path / "te.pt", "--device", "cuda", "--te")
    assert set(te["weights"]) == set(local["weights"])  # the TE names map to the same HF tensors
    assert max_logprob_diff(local, te) < 1e-3 and max_grad_diff(local, te) < 1e-4


@needs_te
def test_fp8_training_step_stays_close_to_bf16(hf_dir, tmp_path):
    recipe = "blockwise" if torch.cuda.get_device_capability()[0] < 10 else "mxfp8"
    bf16 = run(hf_dir, tmp_path / "bf16.pt", "--device", "cuda", "--te", "--dtype", "bfloat16")
    fp8 = run(
        hf_dir,
        tmp_path / "fp8.pt",
        "--device",
        "cuda",
        "--te",
        "--dtype",
        "bfloat16",
        "--fp8",
        "e4m3",
        "--fp8-recipe",
        recipe,
        "--optimizer-step",
    )
    assert all(torch.isfinite(g).all() for g in fp8["runs"]["token-mean/4/0"]["grads"].values())
    assert max_logprob_diff(bf16, fp8) < 0.5  # FP8 matmuls: a loose bound, but not a broken model


@needs_te
def test_thd_packing_with_transformer_engine_matches_padded_rows(hf_dir, tmp_path):
    """trainer.packing=on with TE: packed rows as THD (cu_seqlens) against one padded length, fp32. Until this
    passes on a GPU, trainer.packing=auto leaves TE runs unpacked."""
    out = run(hf_dir, tmp_path / "thd.pt", "--device", "cuda", "--te", "--packing", "off,thd", "--varied-samples",
              "--max-tokens", "0,64")  # fmt: skip
    assert max(max(abs(x - y) for x, y in zip(p, q)) for p, q in zip(out["logprobs_thd"], out["logprobs"])) < 1e-4
    for budget in (0, 64):
        got = {"runs": {"token-mean/4/0": out["runs"][f"token-mean/4/{budget}/thd"]}}
        assert max_grad_diff(got, out) < 1e-5


@needs_te  # Megatron's precision-aware optimizer checks TE's version (mcore/provider.py cpu_offload_problem)
def test_cpu_offload_keeps_no_optimizer_state_on_the_gpu(hf_dir, tmp_path):
    """optimizer.cpu_offload through Megatron's precision-aware path (mcore/actor.py): no fp32 master copy of the
    weights stays on the GPU and Adam's state lives in host memory, as plan.py counts it; the update still
    moves the weights."""
    out = tmp_path / "offload.pt"
    run_torchrun(Path(__file__).parent / "workers" / "cpu_offload.py", 1, str(hf_dir), str(out))
    r = torch.load(out)
    assert r["main_params_on_gpu"] == 0 and r["state_devices"] == ["cpu"] and r["moved"]
    # weights, fp32 grad buffers and activations' leftovers: well under the 4 + 8 B a parameter of the state
    assert r["gpu_bytes"] < r["weight_bytes"] * (1 + 2 + 2)
