"""A resume with optimizer.cpu_offload in the default dp_reshardable format hands the loaded state to the CPU Adam
(mcore/mcore_compat.py sync_offloaded_optimizer_after_load).

Megatron-Core 0.16.1's distributed optimizer puts each loaded tensor into its HybridDeviceOptimizer's `state` as a
new object; the fp32 copies that its CPU sub-optimizers update keep the fresh run's weights, unless
`_sync_hdo_state_to_sub_optimizers` runs, which its dp_reshardable loader does not call: the first update after
a resume wrote the fresh run's weights back. The hybrid optimizer's step needs CUDA params; its state hand-over
does not, so it runs here with Megatron's own loading code (the precision-aware branch of
`_set_main_param_and_optimizer_states`). The whole save, resume and step on a GPU: tools/gpu_check.sh's
offload-resume step.
"""

import inspect
from types import SimpleNamespace
from unittest import mock

import torch

from dapo_mcore.mcore.mcore_compat import sync_offloaded_optimizer_after_load
from tests.unit.test_cpu_adam import megatron_hybrid_kwargs, no_cuda_streams  # noqa: F401 (a fixture)


def stepped_hybrid_optimizer():
    """Megatron's hybrid optimizer over two bf16 parameters, its CPU Adam stepped once (its state exists)."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    params = [torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16)) for _ in range(2)]
    hybrid = HybridDeviceOptimizer([{"params": params, "wd_mult": 1.0}], **megatron_hybrid_kwargs())
    for fp32 in hybrid.param_to_fp32_param.values():
        fp32.grad = torch.ones_like(fp32)
    for cpu_adam in hybrid.cpu_optimizers:
        # without its hook that copies the result to the GPU parameters (there are none on the CPU)
        with mock.patch.dict(cpu_adam._optimizer_step_post_hooks, clear=True):
            cpu_adam.step()
    hybrid._sync_sub_optimizers_state_to_hdo()  # as the end of its own step does
    return hybrid, params


def load_as_megatron_does(hybrid, params) -> dict:
    """Megatron's distributed optimizer (0.16.1) setting each parameter's loaded main weight and moments."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    distributed = SimpleNamespace(
        optimizer=hybrid,
        config=SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=True),
        model_param_group_index_map={p: (0, i) for i, p in enumerate(params)},
    )
    loaded = {}
    for p in params:
        loaded[p] = {"param": p.detach().float() + 10.0, "exp_avg": torch.full((8,), 0.5), "exp_avg_sq": torch.ones(8)}
        DistributedOptimizer._set_main_param_and_optimizer_states(distributed, p, dict(loaded[p]))
    return {"distributed": distributed, "loaded": loaded}


def test_the_cpu_adam_steps_from_the_loaded_state_after_a_dp_reshardable_resume(no_cuda_streams):  # noqa: F811
    hybrid, params = stepped_hybrid_optimizer()
    load = load_as_megatron_does(hybrid, params)
    fp32 = [hybrid.param_to_fp32_param[p] for p in params]
    # the bug without the sync: the weights the CPU Adam updates are still the fresh run's (the moments
    # arrive, the hybrid optimizer's state sharing its sub-optimizers' dicts after a step)
    assert not any(torch.equal(f, load["loaded"][p]["param"]) for p, f in zip(params, fp32))

    assert sync_offloaded_optimizer_after_load(load["distributed"]) == 1
    for p, f in zip(params, fp32):
        state = hybrid.cpu_optimizers[0].state[f]
        assert torch.equal(f, load["loaded"][p]["param"])  # the weights the next update starts from
        assert torch.equal(state["exp_avg"], load["loaded"][p]["exp_avg"]) and state["exp_avg"].device.type == "cpu"


def test_megatrons_dp_reshardable_loader_is_the_one_that_does_not_sync():
    """Why the sync is ours: the other loaders call it (a release that adds it to this one needs no change, the
    sync being idempotent; this test then says the workaround may go)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    def syncs(method) -> bool:
        return "_sync_hdo_state_to_sub_optimizers" in inspect.getsource(method)

    assert syncs(DistributedOptimizer.load_parameter_state_from_fully_reshardable)
    assert not syncs(DistributedOptimizer.load_parameter_state_from_dp_reshardable)


def test_a_megatron_core_outside_the_tested_window_is_warned_about_once(monkeypatch, caplog):
    from dapo_mcore.mcore import mcore_compat

    assert mcore_compat.release_of("0.19.2") == (0, 19) and mcore_compat.release_of("0.20.0rc1") == (0, 20)
    for version, warned in (("0.16.1", False), ("0.19.2", False), ("0.15.0", True), ("0.20.0", True)):
        monkeypatch.setattr(mcore_compat, "installed_version", lambda v=version: v)
        caplog.clear()
        mcore_compat.check_version()
        assert ("outside the tested window 0.16 to 0.19" in caplog.text) is warned, version
