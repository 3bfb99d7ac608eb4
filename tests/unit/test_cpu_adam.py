"""The CPU Adam of optimizer.cpu_offload (dapo_mcore/mcore/cpu_adam.py): Megatron-Core builds it fused from the
project's options, the fused step equals the unfused one, and the step runs at the task's CPU count."""

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from dapo_mcore.mcore.cpu_adam import (
    cpu_adam_is_fused,
    cpu_adam_threads,
    hybrid_optimizers,
    step_at_threads,
    use_task_cpus,
)


class _Built(Exception):
    """Stops Megatron's builder once it has handed its arguments to the hybrid optimizer."""


class _Stream:
    """What the hybrid optimizer's constructor asks of CUDA streams; the CPU-only torch here has none."""

    def record_event(self):
        return mock.Mock()

    def wait_stream(self, stream):
        pass


@pytest.fixture
def no_cuda_streams():
    with mock.patch.object(torch.cuda, "current_stream", _Stream), mock.patch.object(torch.cuda, "Stream", _Stream):
        yield


def megatron_hybrid_kwargs():
    """The arguments Megatron-Core's builder gives HybridDeviceOptimizer for the project's optimizer.cpu_offload
    options (mcore/actor.py megatron_optimizer_options), recorded where it constructs it."""
    import megatron.core.optimizer as mcore_optimizer
    from megatron.core.optimizer import OptimizerConfig

    from dapo_mcore.mcore.actor import OptimizerSettings, megatron_optimizer_options

    opt = OptimizerSettings(1e-6, 0, 0, 1, 0.1, 1.0, 0.9, 0.999, 1e-8, True, cpu_offload=True, offload_fraction=1.0)
    options = megatron_optimizer_options(opt, SimpleNamespace(bf16=True, fp16=False, params_dtype=torch.bfloat16))
    # The precision-aware path asks Transformer Engine's version (not installed here); below 2.1 it only turns
    # off store_param_remainders, which the hybrid optimizer's branch never reads.
    with mock.patch("megatron.core.optimizer.optimizer_config.is_te_min_version", return_value=False):
        config = OptimizerConfig(**options)
    recorded = {}

    def record(params, **kwargs):
        recorded.update(kwargs)
        raise _Built

    groups = [{"params": [torch.nn.Parameter(torch.randn(4))], "wd_mult": 1.0, "lr_mult": 1.0}]
    with mock.patch.object(mcore_optimizer, "HybridDeviceOptimizer", record), pytest.raises(_Built):
        mcore_optimizer._get_megatron_optimizer_based_on_param_groups(config, [], groups)
    return recorded


def test_megatron_builds_the_offloaded_optimizer_with_a_fused_cpu_adamw():
    kwargs = megatron_hybrid_kwargs()
    assert kwargs["cpu_optimizer_cls"] is torch.optim.AdamW
    assert kwargs["fused"] is True and kwargs["param_update_in_fp32"] is True


def test_the_hybrid_optimizer_hands_fused_to_every_cpu_adamw_also_when_rebuilt(no_cuda_streams):
    """With Megatron's arguments, each CPU sub-optimizer's groups say fused=True: with one AdamW and with one a
    parameter (overlap_cpu_optimizer_d2h_h2d), and after the distributed optimizer rebuilds the hybrid one from
    its defaults (distrib_optimizer.py, Megatron-Core 0.16.1)."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    kwargs = megatron_hybrid_kwargs()
    for overlap in (False, True):
        groups = [{"params": [torch.nn.Parameter(torch.randn(8)) for _ in range(3)], "wd_mult": 1.0}]
        hybrid = HybridDeviceOptimizer(groups, **{**kwargs, "overlap_cpu_optimizer_d2h_h2d": overlap})
        rebuilt = HybridDeviceOptimizer(params=hybrid.param_groups, **hybrid.defaults)
        for built in (hybrid, rebuilt):
            assert built.cpu_optimizers and cpu_adam_is_fused(built)
            assert all(type(opt) is torch.optim.AdamW for opt in built.cpu_optimizers)


def test_adamw_takes_the_fused_kernel_from_its_group_as_the_hybrid_optimizer_builds_it():
    """The hybrid optimizer constructs AdamW(groups) with default arguments; AdamW's step reads fused from the
    group, so the fused CPU kernel runs."""
    param = torch.nn.Parameter(torch.randn(16))
    param.grad = torch.randn(16)
    group = {"params": [param], "lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "fused": True}
    opt = torch.optim.AdamW([group])
    kernel = torch._fused_adamw_
    with mock.patch.object(torch, "_fused_adamw_", side_effect=kernel) as fused:
        opt.step()
    assert fused.call_count == 1


def test_fused_cpu_adamw_steps_as_the_unfused_one():
    """Five steps of AdamW with decoupled weight decay on several fp32 tensors: fused and the default single-
    tensor loop agree to float32 rounding."""
    torch.manual_seed(0)
    shapes = [(1000,), (64, 33), (7,)]
    init = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) * 0.1 for s in shapes] for _ in range(5)]
    results = []
    for fused in (None, True):
        params = [torch.nn.Parameter(p.clone()) for p in init]
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8, fused=fused)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            opt.step()
        results.append([p.detach() for p in params])
    for unfused, fused, start in zip(*results, init):
        assert not torch.equal(fused, start)
        torch.testing.assert_close(fused, unfused, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "env, affinity, threads",
    [
        ({"SLURM_CPUS_PER_TASK": "8", "LOCAL_WORLD_SIZE": "8"}, 64, 8),  # Slurm's share, bound or not
        ({"SLURM_CPUS_PER_TASK": "8"}, 4, 4),  # never more than the process may run on
        ({"LOCAL_WORLD_SIZE": "8"}, 128, 16),  # torchrun: the node's CPUs over its local ranks
        ({"LOCAL_WORLD_SIZE": "8"}, 2, 1),
        ({}, 6, 6),  # one process
    ],
)
def test_cpu_adam_threads_are_the_tasks_cpus(env, affinity, threads):
    assert cpu_adam_threads(env, affinity)[0] == threads


def test_the_step_runs_at_the_given_threads_and_puts_the_process_count_back():
    param = torch.nn.Parameter(torch.randn(32))
    param.grad = torch.randn(32)
    opt = torch.optim.AdamW([param], fused=True)
    step_at_threads(opt, 2)
    seen, kernel = [], torch._fused_adamw_

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return kernel(*args, **kwargs)

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with mock.patch.object(torch, "_fused_adamw_", spy):
            opt.step()
        assert seen == [2] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_use_task_cpus_finds_the_hybrid_optimizer_inside_megatrons_and_hooks_it(no_cuda_streams):
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    groups = [{"params": [torch.nn.Parameter(torch.randn(8))], "wd_mult": 1.0}]
    hybrid = HybridDeviceOptimizer(groups, **megatron_hybrid_kwargs())
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=hybrid)])
    assert hybrid_optimizers(chained) == [hybrid]
    assert use_task_cpus(chained, {"SLURM_CPUS_PER_TASK": "1"}) == 1
    assert len(hybrid._optimizer_step_pre_hooks) == len(hybrid._optimizer_step_post_hooks) == 1
    assert getattr(HybridDeviceOptimizer.step, "hooked", False)  # torch runs them around its overridden step
    plain = SimpleNamespace(optimizer=torch.optim.AdamW([torch.nn.Parameter(torch.randn(2))]))
    assert use_task_cpus(plain, {"SLURM_CPUS_PER_TASK": "8"}) == 0
