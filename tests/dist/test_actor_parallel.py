"""The actor's loss, per-token log-probs and gradients do not depend on the parallel layout, the micro-batch
split or the token budget (DESIGN.md rule 10), and equal Hugging Face transformers' on the same weights.

Tolerances (fp32 on the CPU): gradients to 1e-6 absolute (observed: at most 3e-8, reduction-order noise),
log-probs to 1e-5 (observed 5e-7), losses to 1e-6 relative, weights after an optimizer step to 1e-6.
"""

import json
from pathlib import Path

import pytest
import torch

from dapo_mcore.algo.losses import LOSS_AGG_MODES
from tests.conftest import run_torchrun
from tests.helpers import random_samples, save_tiny_model

WORKER = Path(__file__).parent / "workers" / "actor_grads.py"
GRAD_ATOL, LOGPROB_ATOL, LOSS_RTOL = 1e-6, 1e-5, 1e-6
ALL_MODES = ",".join(LOSS_AGG_MODES)


class Layouts:
    """Runs the worker for one model at the layouts asked for, each (layout, options) once per module."""

    def __init__(self, hf_dir: Path, out: Path):
        self.hf_dir, self.out, self._cache = hf_dir, out, {}
        out.mkdir(parents=True, exist_ok=True)

    def run(self, nproc=1, **options) -> dict:
        prefetch([(self, nproc, options)])
        return self._cache[_key(nproc, options)]


def _key(nproc: int, options: dict) -> tuple:
    return nproc, tuple(sorted(options.items()))


def prefetch(wanted: list[tuple[Layouts, int, dict]]) -> None:
    """Make the runs in `wanted` not cached yet, for any of the models: one torchrun launch per process count,
    the worker building them one after another (the start-up of its processes is paid once, not per run)."""
    batches: dict[int, list[tuple[Layouts, tuple, list[str], Path]]] = {}
    for layouts, nproc, options in wanted:
        key = _key(nproc, options)
        queued = [(m, k) for m, k, _, _ in batches.get(nproc, [])]
        if key in layouts._cache or (layouts, key) in queued:
            continue
        args = []
        for name, value in sorted(options.items()):
            flag = "--" + name.replace("_", "-")
            args += [flag] if value is True else [flag, str(value)]
        out = layouts.out / f"run{len(layouts._cache)}-{nproc}-{len(batches.get(nproc, []))}.pt"
        batches.setdefault(nproc, []).append((layouts, key, [str(layouts.hf_dir), str(out), *args], out))
    for nproc, runs in batches.items():
        batch = runs[0][0].out / f"batch-{nproc}-{len(runs[0][0]._cache)}.json"
        batch.write_text(json.dumps([argv for _, _, argv, _ in runs]))
        run_torchrun(WORKER, nproc, "--batch", str(batch))
        for layouts, key, _, out in runs:
            layouts._cache[key] = torch.load(out)


def assert_same(result, reference, run="token-mean/4/0", reference_run="token-mean/4/0"):
    got, want = result["runs"][run], reference["runs"][reference_run]
    assert got["loss"] == pytest.approx(want["loss"], rel=LOSS_RTOL)
    assert set(got["grads"]) == set(want["grads"])
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=0, atol=GRAD_ATOL, msg=name)
    for got_lp, want_lp in zip(result["logprobs"], reference["logprobs"]):
        torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), rtol=0, atol=LOGPROB_ATOL)


SINGLE = {"micro_batch_sizes": "4,8,16", "loss_agg_modes": ALL_MODES, "max_tokens": "0,48,100"}
LAYOUTS = [(2, {"tp": 2}), (2, {"pp": 2}), (4, {"tp": 2, "pp": 2}), (2, {}), (2, {"tp": 2, "sp": True})]
PACKED_BUDGET = 64  # the longest varied sample is exactly this long: it fills a packed row alone
PACKED = {"packing": "off,mask", "varied_samples": True, "max_tokens": f"0,{PACKED_BUDGET}"}
PACKED_LAYOUTS = [(1, {}), (2, {"tp": 2}), (2, {"pp": 2}), (4, {"tp": 2, "pp": 2}), (2, {})]
PACKED_OPTIONS = [(2, {"tp": 2, "sp": True, "recompute": "full"}), (2, {"pp": 2, "naive_logprobs": True})]
HEAD_LOSS_GRAD = {"loss_agg_modes": "token-mean,seq-mean-token-mean", "entropy_coeffs": "0,0.1"}
PACKED_HEAD_LOSS_GRAD = {"tp": 2, "packing": "mask", "varied_samples": True, "max_tokens": PACKED_BUDGET,
                         **HEAD_LOSS_GRAD}  # fmt: skip
# The policy losses beside dapo, with a rollout correction that weights each token: every run of a loss, at any
# micro-batch size and at TP 2 (fused head: cispo and sapo take their per-token gradient in its forward; gspo,
# a sequence-level ratio, the unfused one), equals the one-process run of 4-sample micro-batches.
POLICY_LOSS_RUNS = {"policy_losses": "dapo,gspo,cispo,sapo", "loss_agg_modes": "token-mean,seq-mean-token-mean",
                    "micro_batch_sizes": "4,16", "tis": "token"}  # fmt: skip
# Context parallelism (docs/design/context_parallel.md section 9 steps 4-5): every sequence split over 2 CP ranks
# (rows as Megatron's load-balanced chunks, packed rows as THD with slot padding), the loss's per-sequence sums
# totalled over them. CP_POLICY's reference is the one-process POLICY_LOSS_RUNS (same samples, tis="token");
# CP_SEQUENCE_SUMS has sequence TIS (a product of weights over the whole sequence) and a sequence count.
CP_POLICY = {"cp": 2, "policy_losses": "dapo,gspo", "loss_agg_modes": "token-mean,seq-mean-token-mean",
             "micro_batch_sizes": "4", "tis": "token"}  # fmt: skip
CP_SEQUENCE_SUMS = {"policy_losses": "dapo,gspo", "loss_agg_modes": "seq-mean-token-mean,seq-mean-token-sum",
                    "tis": "sequence"}  # fmt: skip
CP_PACKED_LAYOUTS = [(2, {"cp": 2, "loss_agg_modes": "token-mean,seq-mean-token-mean"}),
                     (4, {"tp": 2, "sp": True, "cp": 2}), (4, {"pp": 2, "cp": 2})]  # fmt: skip
CP_RUNS = [(2, CP_POLICY), (1, CP_SEQUENCE_SUMS), (2, {"cp": 2, **CP_SEQUENCE_SUMS}),
           *[(n, {**PACKED, **options}) for n, options in CP_PACKED_LAYOUTS]]  # fmt: skip
# Every run the tests below ask `llama` for, made in one launch per process count when the module starts (a run
# missing here is still made, in a launch of its own, when a test asks for it).
LLAMA_RUNS = [
    (1, SINGLE),
    *LAYOUTS,
    (2, {"loss_agg_modes": ALL_MODES, "max_tokens": "0,48"}),
    *[(n, {**layout, "recompute": r}) for r in ("selective", "full") for n, layout in ((1, {}), (2, {"pp": 2}))],
    (1, {"optimizer_step": True}),
    (2, {"optimizer_step": True, "dist_opt": True}),
    (2, {"tp": 2, "optimizer_step": True, "dist_opt": True}),
    *[(n, {"tp": n, **extra}) for n in (1, 2) for extra in ({}, {"naive_logprobs": True})],
    *[(n, {"tp": n, **HEAD_LOSS_GRAD, **extra}) for n in (1, 2) for extra in ({}, {"recompute_logits": True})],
    (1, {}),
    *[(n, {**PACKED, "loss_agg_modes": ALL_MODES, **layout}) for n, layout in PACKED_LAYOUTS],
    *[(n, {**PACKED, **options}) for n, options in PACKED_OPTIONS],
    (2, PACKED_HEAD_LOSS_GRAD),
    (2, {**PACKED_HEAD_LOSS_GRAD, "recompute_logits": True}),
    (1, POLICY_LOSS_RUNS),
    (2, {"tp": 2, **POLICY_LOSS_RUNS}),
    *CP_RUNS,
]


# The tests Megatron-Core's other end of the window runs (tests/dist/test_mcore_window.py: 0.19.2 on Python 3.12),
# and their runs: when only those are selected, the module makes only these (two launches, not the whole list).
WINDOW_TESTS = (
    "test_layout_matches_the_single_process_run[tp2]",
    "test_layout_matches_the_single_process_run[pp2]",
    "test_distributed_optimizer_step_matches_the_single_process_step",
)
WINDOW_RUNS = [
    (1, SINGLE),
    (2, {"tp": 2}),
    (2, {"pp": 2}),
    (1, {"optimizer_step": True}),
    (2, {"optimizer_step": True, "dist_opt": True}),
    (2, {"tp": 2, "optimizer_step": True, "dist_opt": True}),
]


VPP_RUNS = [(1, {}), (2, {"pp": 2, "vpp": 2}), (4, {"tp": 2, "pp": 2, "vpp": 2, "max_tokens": 48}),
            (2, {"pp": 2, "vpp": 2, "packing": "mask"})]  # fmt: skip
TIED_RUNS = [(1, {}), (4, {"tp": 2, "pp": 2})]


@pytest.fixture(scope="module")
def vpp_model(tmp_path_factory) -> Layouts:
    """4 layers: 2 pipeline stages of 2 virtual stages each."""
    out = tmp_path_factory.mktemp("vpp")
    return Layouts(save_tiny_model(out / "hf", "llama", layers=4), out)


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> Layouts:
    out = tmp_path_factory.mktemp("tied")
    return Layouts(save_tiny_model(out / "hf", "qwen3", tie=True, layers=2), out)


@pytest.fixture(scope="module")
def llama(request, tmp_path_factory, vpp_model, tied_model) -> Layouts:
    """The main model; its runs and the other models' are made together when the module starts."""
    out = tmp_path_factory.mktemp("layouts")
    layouts = Layouts(save_tiny_model(out / "hf", "llama", layers=2), out)
    selected = {item.name for item in request.session.items if item.module is request.module}
    if selected <= set(WINDOW_TESTS):
        prefetch([(layouts, *run) for run in WINDOW_RUNS])
        return layouts
    wanted = [(layouts, *run) for run in LLAMA_RUNS] + [(vpp_model, *run) for run in VPP_RUNS]
    prefetch(wanted + [(tied_model, *run) for run in TIED_RUNS])
    return layouts


@pytest.fixture(scope="module")
def single(llama) -> dict:
    return llama.run(**SINGLE)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gradient_is_the_same_for_1_2_and_4_micro_batches(single, mode):
    for mbs in (8, 16):
        assert_same(single, single, run=f"{mode}/{mbs}/0", reference_run=f"{mode}/4/0")


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gradient_is_the_same_for_any_token_budget(single, mode):
    for budget in (48, 100):  # 48 tokens: about two samples per micro-batch; 100: four or more
        assert_same(single, single, run=f"{mode}/4/{budget}", reference_run=f"{mode}/4/0")


@pytest.mark.parametrize("nproc, options", LAYOUTS, ids=["tp2", "pp2", "tp2xpp2", "dp2", "tp2+sp"])
def test_layout_matches_the_single_process_run(llama, single, nproc, options):
    assert_same(llama.run(nproc, **options), single)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_every_loss_aggregation_is_the_same_at_dp2_with_token_budgets(llama, single, mode):
    dp2 = llama.run(2, loss_agg_modes=ALL_MODES, max_tokens="0,48")
    for budget in (0, 48):
        assert_same(dp2, single, run=f"{mode}/4/{budget}", reference_run=f"{mode}/4/0")


def test_virtual_pipeline_stages_match_the_single_process_run(llama, vpp_model):
    reference = vpp_model.run()
    assert_same(vpp_model.run(2, pp=2, vpp=2), reference)
    assert_same(vpp_model.run(4, tp=2, pp=2, vpp=2, max_tokens=48), reference, run="token-mean/4/48")
    assert_same(vpp_model.run(2, pp=2, vpp=2, packing="mask"), reference, run="token-mean/4/0/mask")


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_activation_recompute_gives_the_same_gradients(llama, single, recompute):
    assert_same(llama.run(recompute=recompute), single)
    assert_same(llama.run(2, pp=2, recompute=recompute), single)


def test_distributed_optimizer_step_matches_the_single_process_step(llama):
    reference = llama.run(optimizer_step=True)
    for result in (
        llama.run(2, optimizer_step=True, dist_opt=True),
        llama.run(2, tp=2, optimizer_step=True, dist_opt=True),
    ):
        moved = 0.0
        for name, weight in reference["stepped"].items():
            torch.testing.assert_close(result["stepped"][name], weight, rtol=0, atol=1e-6, msg=name)
            moved = max(moved, (weight - reference["weights"][name]).abs().max().item())
        assert moved > 1e-3  # the step did move the weights


@pytest.mark.parametrize("policy_loss", ["gspo", "cispo", "sapo"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_every_policy_loss_is_the_same_for_any_micro_batch_split_and_at_tp2(llama, policy_loss, mode):
    one, tp2 = llama.run(1, **POLICY_LOSS_RUNS), llama.run(2, tp=2, **POLICY_LOSS_RUNS)
    reference = f"{mode}/4/0/{policy_loss}"
    assert_same(one, one, run=f"{mode}/16/0/{policy_loss}", reference_run=reference)
    assert_same(tp2, one, run=f"{mode}/4/0/{policy_loss}", reference_run=reference)
    assert_same(tp2, one, run=f"{mode}/16/0/{policy_loss}", reference_run=reference)
    # not DAPO's gradient under another name
    dapo, other = one["runs"][f"{mode}/4/0"]["grads"], one["runs"][reference]["grads"]
    assert any(not torch.allclose(dapo[name], other[name], rtol=1e-3, atol=1e-6) for name in dapo)


@pytest.mark.parametrize("tp, nproc", [(1, 1), (2, 2)], ids=["tp1", "tp2"])
def test_fused_logprob_head_equals_full_logits(llama, tp, nproc):
    """The chunked head (5-token chunks here) against Megatron's output layer + full-vocab log-softmax."""
    assert_same(llama.run(nproc, tp=tp), llama.run(nproc, tp=tp, naive_logprobs=True))


@pytest.mark.parametrize("tp, nproc", [(1, 1), (2, 2)], ids=["tp1", "tp2"])
def test_loss_gradient_taken_in_the_head_forward_equals_the_logits_recompute_path(llama, tp, nproc):
    """The default head takes the DAPO loss's per-token gradient inside its forward chunk loop; the other
    recomputes each chunk's logits in backward. Same losses and parameter gradients, with and without
    the entropy bonus, for a token-level and a sequence-level aggregation."""
    options = {"tp": tp, **HEAD_LOSS_GRAD}
    in_forward, recompute = llama.run(nproc, **options), llama.run(nproc, recompute_logits=True, **options)
    assert len(in_forward["runs"]) == 4
    for run in in_forward["runs"]:
        assert_same(in_forward, recompute, run=run, reference_run=run)


def test_weight_export_gives_back_the_hf_checkpoint_bit_for_bit(llama):
    from safetensors.torch import load_file

    on_disk = load_file(llama.hf_dir / "model.safetensors")
    for result in (llama.run(), llama.run(4, tp=2, pp=2)):
        assert set(result["weights"]) == set(on_disk)
        for name, tensor in on_disk.items():
            assert torch.equal(result["weights"][name], tensor), name


@pytest.mark.parametrize("family, tie", [("llama", False), ("llama3", False), ("qwen2", False), ("qwen3", True)])
def test_megatron_logprobs_equal_hf_transformers_on_the_same_weights(llama, tmp_path, family, tie):
    from transformers import AutoModelForCausalLM

    layouts = llama if family == "llama" else Layouts(save_tiny_model(tmp_path / "hf", family, tie=tie), tmp_path)
    model = AutoModelForCausalLM.from_pretrained(layouts.hf_dir, dtype=torch.float32).eval()
    for sample, mcore_lp in zip(random_samples(16, seed=7), layouts.run()["logprobs"]):
        ids = torch.tensor([sample.prompt_ids + sample.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(sample.prompt_ids) - 1 : -1] / 0.9  # worker's temperature
        hf_lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(sample.response_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(mcore_lp), hf_lp, rtol=0, atol=LOGPROB_ATOL)
    # RoPE frequencies exactly (at these short lengths llama3 scaling moves log-probs by only ~2e-5)
    hf_inv_freq = model.model.rotary_emb.inv_freq.float()
    torch.testing.assert_close(layouts.run()["rope_inv_freq"].float(), hf_inv_freq, rtol=1e-6, atol=0)


def test_tied_embeddings_with_qk_norm_at_tp2_x_pp2(llama, tied_model):
    reference = tied_model.run()
    assert "lm_head.weight" not in reference["runs"]["token-mean/4/0"]["grads"]  # tied: one tensor
    assert_same(tied_model.run(4, tp=2, pp=2), reference)


@pytest.mark.parametrize("nproc, options", PACKED_LAYOUTS, ids=["single", "tp2", "pp2", "tp2xpp2", "dp2"])
def test_packed_rows_give_the_padded_log_probs_loss_and_gradients(llama, nproc, options):
    """Samples of 3 to 64 tokens (one with a single response token) packed under a block-diagonal causal mask,
    in rows of the longest sample (4 per micro-batch) or of the token budget, against one padded length, at
    each layout (the layout's options were not passed before issue 21: every case ran plain DP)."""
    result = llama.run(nproc, **PACKED, loss_agg_modes=ALL_MODES, **options)
    for got, want in zip(result["logprobs_mask"], result["logprobs"]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=GRAD_ATOL)
    for mode in LOSS_AGG_MODES:
        for budget in (0, PACKED_BUDGET):
            assert_same(result, result, run=f"{mode}/4/{budget}/mask", reference_run=f"{mode}/4/0")


@pytest.mark.parametrize("nproc, options", PACKED_OPTIONS, ids=["tp2+sp+full-recompute", "pp2+full-logits-head"])
def test_packed_rows_with_sequence_parallel_recompute_and_the_full_logits_head(llama, nproc, options):
    """Packing is on by default with the local spec, so also with these options: same log-probs, loss and
    gradients as padded rows."""
    result = llama.run(nproc, **PACKED, **options)
    for got, want in zip(result["logprobs_mask"], result["logprobs"]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=GRAD_ATOL)
    for budget in (0, PACKED_BUDGET):
        assert_same(result, result, run=f"token-mean/4/{budget}/mask", reference_run="token-mean/4/0")


def test_packed_rows_take_the_loss_gradient_in_the_head_forward_as_the_recompute_path_does(llama):
    """Packed rows hold several samples; the head's per-token loss constants are laid out per sample and
    mapped to the tokens' places in the rows. Same losses and gradients as recomputing the logits, with and
    without the entropy bonus, at TP=2."""
    in_forward = llama.run(2, **PACKED_HEAD_LOSS_GRAD)
    recompute = llama.run(2, recompute_logits=True, **PACKED_HEAD_LOSS_GRAD)
    assert len(in_forward["runs"]) == 4
    for run in in_forward["runs"]:
        assert_same(in_forward, recompute, run=run, reference_run=run)


@pytest.mark.parametrize("policy_loss", ["dapo", "gspo"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_context_parallel_2_gives_the_single_process_loss_log_probs_and_gradients(llama, policy_loss, mode):
    """Each sample's row split over 2 CP ranks (chunks r and 3 - r of 4): the log-probs gathered back, the loss
    and the gradients equal one process's; gspo's sequence ratio and seq-mean-token-mean's token counts are
    sums over both ranks' tokens."""
    one, cp2 = llama.run(1, **POLICY_LOSS_RUNS), llama.run(2, **CP_POLICY)
    run = f"{mode}/4/0" + ("" if policy_loss == "dapo" else f"/{policy_loss}")
    assert_same(cp2, one, run=run, reference_run=run)


def test_context_parallel_2_sums_sequence_tis_and_counts_each_sequence_once(llama):
    """Sequence TIS (a product of weights over the sequence's tokens, on both ranks) and seq-mean-token-sum's
    sequence count (counted by CP rank 0 only): same loss and gradients as one process."""
    one, cp2 = llama.run(1, **CP_SEQUENCE_SUMS), llama.run(2, cp=2, **CP_SEQUENCE_SUMS)
    assert len(cp2["runs"]) == 4
    for run in one["runs"]:
        assert_same(cp2, one, run=run, reference_run=run)


@pytest.mark.parametrize("nproc, options", CP_PACKED_LAYOUTS, ids=["cp2", "tp2+sp-x-cp2", "pp2-x-cp2"])
def test_context_parallel_packed_thd_rows_and_token_budgets_match_the_single_process_run(llama, nproc, options):
    """Padded rows and packed rows (THD under CP: each sample's slot a multiple of 2 CP, split per sequence), with
    and without a token budget, at CP 2 alone, with TP 2 + SP and with PP 2 (the schedule's whole-row length):
    the one-process log-probs, losses and gradients."""
    one = llama.run(1, **PACKED, loss_agg_modes=ALL_MODES)
    result = llama.run(nproc, **PACKED, **options)
    for got, want in zip(result["logprobs_mask"], one["logprobs"]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=LOGPROB_ATOL)
    assert len(result["runs"]) == 4 * len(options.get("loss_agg_modes", "token-mean").split(","))
    for run in result["runs"]:
        assert_same(result, one, run=run, reference_run=run)
