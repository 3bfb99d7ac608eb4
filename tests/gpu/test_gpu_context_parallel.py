"""GPU tier: what one GPU settles about context parallelism (docs/design/context_parallel.md section 9 step 10).
Skipped without CUDA (tests/conftest.py) and, each with its reason, without Transformer Engine.

- TE's THD partition (`transformer_engine_torch.thd_get_partitioned_indices`, which Megatron's
  get_thd_batch_on_this_cp_rank calls) selects the columns of dapo_mcore.data.batching.thd_cp_columns, every rank,
  C in {2, 4}, random cu_seqlens: the CPU suite's CP split is TE's.
- TE's core attention (Megatron's TEDotProductAttention) at C = 1 equals the CPU twin CPAllGatherAttention on the
  same bf16 queries, keys and values: THD rows (the twin's CP path) and causal bshd rows; outputs and dQ, dK, dV.
- The actor's log-probs and gradients with TE layers on THD packed rows equal the local spec's on the same rows at
  C = 1 (its block-mask path, which the twin equals to 1e-6 on the CPU: tests/unit/test_cp_attention.py), fp32.

TE's CP collectives at C > 1 (p2p ring for THD, all_gather for bshd) need one GPU per rank: NCCL refuses two ranks
on one device, so they stay unverified until a multi-GPU machine (docs/gpu.md).
"""

from pathlib import Path

import pytest
import torch

from dapo_mcore.data.batching import thd_cp_columns
from dapo_mcore.mcore.provider import transformer_engine_available
from tests.conftest import run_torchrun
from tests.helpers import save_tiny_model

WORKERS = Path(__file__).parent / "workers"
ACTOR_WORKER = Path(__file__).parents[1] / "dist" / "workers" / "actor_grads.py"
needs_te = pytest.mark.skipif(not transformer_engine_available(), reason="needs transformer_engine")
BF16_RELATIVE = 0.03  # max |TE - twin| over max |twin|: bf16 keeps 8 significant bits (0.4 %)


def partitioned_indices():
    """TE's THD partition, imported as Megatron does (megatron/core/utils.py: `import transformer_engine` registers
    the kernels, then `import transformer_engine_torch as tex`); a skip, with why, where it is missing."""
    try:
        import transformer_engine  # noqa: F401
        import transformer_engine_torch as tex
    except ImportError as e:
        pytest.skip(f"needs transformer_engine_torch ({e})")
    found = getattr(tex, "thd_get_partitioned_indices", None)
    if found is None:
        pytest.skip(
            "transformer_engine_torch has no thd_get_partitioned_indices (Megatron's get_thd_batch_on_this_cp_rank "
            "calls it, TE >= 1.10): the THD split cannot be compared with TE's"
        )
    return found


def random_cu_seqlens(cp: int, seed: int) -> torch.Tensor:
    """[n + 1] int32: 1 to 12 sequences, each a multiple of 2C long (slot padding), some of exactly 2C."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 13, (1,), generator=g))
    lengths = torch.randint(1, 9, (n,), generator=g) * 2 * cp
    lengths[0] = 2 * cp
    return torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cp", [2, 4])
def test_te_thd_partitioned_indices_equal_thd_cp_columns(cp, seed):
    te_indices = partitioned_indices()
    cu = random_cu_seqlens(cp, seed)
    total = int(cu[-1])
    got = []
    for rank in range(cp):
        te = te_indices(cu.cuda(), total, cp, rank).long().cpu()
        ours = thd_cp_columns(cu.long(), cp, rank)
        assert te.tolist() == ours.tolist(), f"C={cp} rank {rank}, cu_seqlens {cu.tolist()}"
        got.append(te)
    assert sorted(torch.cat(got).tolist()) == list(range(total))  # the ranks partition the row


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


@needs_te
def test_te_attention_at_cp_1_equals_the_cpu_twin_on_thd_and_bshd_rows(tmp_path):
    out = tmp_path / "cp_attention.pt"
    run_torchrun(WORKERS / "cp_attention.py", 1, str(out))
    result = torch.load(out)
    errors = {
        f"{layout} {name}": relative_error(te, twin)
        for layout in ("thd", "bshd")
        for name, te, twin in zip(("output", "dQ", "dK", "dV"), result[layout]["te"], result[layout]["twin"])
    }
    assert all(t.isfinite().all() for layout in ("thd", "bshd") for t in result[layout]["te"])
    assert max(errors.values()) < BF16_RELATIVE, errors


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("gpu-cp") / "hf", "llama", layers=2)


@needs_te
def test_actor_te_thd_logprobs_at_cp_1_equal_the_local_packed_path(hf_dir, tmp_path):
    """The actor at CP 1 on the same packed rows: TE layers as THD (cu_seqlens) against the local spec's
    block-mask path, the CPU-mode reference of the CP tests; fp32 (TF32 off in the worker)."""
    common = ("--device", "cuda", "--varied-samples", "--max-tokens", "64")
    run_torchrun(ACTOR_WORKER, 1, str(hf_dir), str(tmp_path / "local.pt"), *common, "--packing", "mask")
    run_torchrun(ACTOR_WORKER, 1, str(hf_dir), str(tmp_path / "te.pt"), *common, "--te", "--packing", "thd")
    local, te = torch.load(tmp_path / "local.pt"), torch.load(tmp_path / "te.pt")
    logprob_gap = max(max(abs(x - y) for x, y in zip(p, q)) for p, q in zip(local["logprobs"], te["logprobs"]))
    assert logprob_gap < 1e-3, logprob_gap  # the bound of TE against the local spec unpacked (test_gpu.py)
    mask, thd = local["runs"]["token-mean/4/64/mask"]["grads"], te["runs"]["token-mean/4/64/thd"]["grads"]
    assert set(mask) == set(thd)
    grad_gap = max((mask[k] - thd[k]).abs().max().item() for k in mask)
    assert grad_gap < 1e-4, grad_gap
