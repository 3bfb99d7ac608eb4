"""The actor's loss, per-token log-probs and gradients do not depend on the parallel layout or on the
micro-batch split (DESIGN.md rule 10), and equal Hugging Face transformers' on the same weights.

Tolerances (fp32 on the CPU): gradients to 1e-6 absolute (observed: at most 3e-8, reduction-order noise),
log-probs to 1e-5 (observed 5e-7), losses to 1e-6 relative.
"""

from pathlib import Path

import pytest
import torch

from dapo_mcore.algo.losses import LOSS_AGG_MODES
from tests.conftest import run_torchrun
from tests.helpers import random_samples, save_tiny_model

WORKER = Path(__file__).parent / "workers" / "actor_grads.py"
GRAD_ATOL, LOGPROB_ATOL, LOSS_RTOL = 1e-6, 1e-5, 1e-6


ALL_MODES = ",".join(LOSS_AGG_MODES)


def run_layout(hf_dir, out_dir, tp=1, pp=1, nproc=1, sizes="4", modes="token-mean", naive=False):
    out = out_dir / f"tp{tp}_pp{pp}_n{nproc}_{sizes.replace(',', '-')}_{len(modes)}{'_naive' * naive}.pt"
    args = ["--tp", str(tp), "--pp", str(pp), "--micro-batch-sizes", sizes, "--loss-agg-modes", modes]
    run_torchrun(WORKER, nproc, str(hf_dir), str(out), *args, *(["--naive-logprobs"] if naive else []))
    return torch.load(out)


def assert_same(result, reference, run="token-mean/4", reference_run="token-mean/4"):
    got, want = result["runs"][run], reference["runs"][reference_run]
    assert got["loss"] == pytest.approx(want["loss"], rel=LOSS_RTOL)
    assert set(got["grads"]) == set(want["grads"])
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=0, atol=GRAD_ATOL, msg=name)
    for got_lp, want_lp in zip(result["logprobs"], reference["logprobs"]):
        torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), rtol=0, atol=LOGPROB_ATOL)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts")
    hf_dir = save_tiny_model(out / "hf", "llama", layers=2)
    return hf_dir, out, run_layout(hf_dir, out, sizes="4,8,16", modes=ALL_MODES)


@pytest.fixture(scope="module")
def llama_layout(llama):
    """Runs each layout of the llama model once per module."""
    hf_dir, out, _ = llama
    cache = {}

    def get(tp, pp, nproc):
        if (tp, pp, nproc) not in cache:
            modes = ALL_MODES if (tp, pp) == (1, 1) else "token-mean"  # DP=2 checks every aggregation mode
            cache[tp, pp, nproc] = run_layout(hf_dir, out, tp=tp, pp=pp, nproc=nproc, modes=modes)
        return cache[tp, pp, nproc]

    return get


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gradient_is_the_same_for_1_2_and_4_micro_batches(llama, mode):
    _, _, single = llama
    for mbs in (8, 16):
        assert_same(single, single, run=f"{mode}/{mbs}", reference_run=f"{mode}/4")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_every_loss_aggregation_is_the_same_at_dp2(llama, llama_layout, mode):
    assert_same(llama_layout(1, 1, 2), llama[2], run=f"{mode}/4", reference_run=f"{mode}/4")


@pytest.mark.parametrize("tp, pp, nproc", [(2, 1, 2), (1, 2, 2), (2, 2, 4), (1, 1, 2)],
                         ids=["tp2", "pp2", "tp2xpp2", "dp2"])
def test_layout_matches_the_single_process_run(llama, llama_layout, tp, pp, nproc):
    assert_same(llama_layout(tp, pp, nproc), llama[2])


@pytest.mark.parametrize("tp, nproc", [(1, 1), (2, 2)], ids=["tp1", "tp2"])
def test_fused_logprob_head_equals_full_logits(llama, tp, nproc):
    """The chunked head (5-token chunks here) against Megatron's output layer + full-vocab log-softmax."""
    hf_dir, out, single = llama
    fused = single if tp == 1 else run_layout(hf_dir, out, tp=tp, nproc=nproc)
    assert_same(fused, run_layout(hf_dir, out, tp=tp, nproc=nproc, naive=True))


@pytest.mark.parametrize("tp, pp, nproc", [(2, 2, 4)], ids=["tp2xpp2"])
def test_weight_export_gives_back_the_hf_checkpoint_bit_for_bit(llama, llama_layout, tp, pp, nproc):
    from safetensors.torch import load_file

    hf_dir, _, single = llama
    on_disk = load_file(hf_dir / "model.safetensors")
    for result in (single, llama_layout(tp, pp, nproc)):
        assert set(result["weights"]) == set(on_disk)
        for name, tensor in on_disk.items():
            assert torch.equal(result["weights"][name], tensor), name


def test_megatron_logprobs_equal_hf_transformers_on_the_same_weights(llama):
    from transformers import AutoModelForCausalLM

    hf_dir, _, single = llama
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for sample, mcore_lp in zip(random_samples(16, seed=7), single["logprobs"]):
        ids = torch.tensor([sample.prompt_ids + sample.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(sample.prompt_ids) - 1 : -1] / 0.9  # worker's temperature
        hf_lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(sample.response_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(mcore_lp), hf_lp, rtol=0, atol=LOGPROB_ATOL)


def test_tied_embeddings_with_qk_norm_at_tp2_x_pp2(tmp_path):
    hf_dir = save_tiny_model(tmp_path / "hf", "qwen3", tie=True, layers=2)
    single = run_layout(hf_dir, tmp_path)
    assert "lm_head.weight" not in single["runs"]["token-mean/4"]["grads"]  # tied: one tensor, both contributions
    assert_same(run_layout(hf_dir, tmp_path, tp=2, pp=2, nproc=4), single)
