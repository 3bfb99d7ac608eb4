"""The CPU Adam of optimizer.cpu_offload: Megatron-Core's HybridDeviceOptimizer steps its host share with
torch.optim.AdamW, and that step runs on the task's CPUs.

Fused: Megatron-Core 0.16.1 (megatron/core/optimizer/__init__.py, _get_megatron_optimizer_based_on_param_groups)
builds the hybrid optimizer with `fused=True` among its defaults; they reach every param group, the hybrid
optimizer copies its groups into each CPU AdamW (and again before every step), and AdamW's step reads
`group["fused"]`: the CPU sub-optimizer runs torch's fused kernel although its constructor got default
arguments (tests/unit/test_cpu_adam.py checks both halves, so an upgrade that drops it fails there).
`cpu_adam_is_fused` reads it off the built optimizer for the start-up log.

Threads: slurm/train.sbatch exports OMP_NUM_THREADS=1 (eight tasks a node must not oversubscribe the cores while
the engine, the verifier workers and the data path run), which would leave the Adam step on one core of the
task's eight. The step alone runs at the task's CPU count (`cpu_adam_threads`), set by the optimizer's own
step pre-hook and put back by its post-hook, so nothing else in the process changes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from dapo_mcore.utils.logging import get_logger

log = get_logger(__name__)


def cpu_adam_threads(env: Mapping[str, str], affinity: int) -> tuple[int, str]:
    """Threads for the CPU Adam step and where the count came from. Slurm's --cpus-per-task is the task's
    share even when srun binds nothing; without it (torchrun) the CPUs this process may run on are shared by
    the node's local ranks. Never more than the affinity allows."""
    cpus = env.get("SLURM_CPUS_PER_TASK", "")
    if cpus.isdigit() and int(cpus) > 0:
        return max(1, min(int(cpus), affinity)), f"SLURM_CPUS_PER_TASK={cpus}"
    local = env.get("LOCAL_WORLD_SIZE", "")
    ranks = int(local) if local.isdigit() and int(local) > 0 else 1
    return max(1, affinity // ranks), f"{affinity} CPUs of this process's affinity / {ranks} local ranks"


def hybrid_optimizers(optimizer: Any) -> list[Any]:
    """The HybridDeviceOptimizers inside Megatron's (chained, distributed) optimizer."""
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    inner = [getattr(opt, "optimizer", None) for opt in getattr(optimizer, "chained_optimizers", [optimizer])]
    return [opt for opt in inner if isinstance(opt, HybridDeviceOptimizer)]


def step_at_threads(optimizer: torch.optim.Optimizer, threads: int) -> None:
    """Run every `optimizer.step()` at `threads` torch intra-op threads, the process's count restored after.
    On the hybrid optimizer itself, not its CPU sub-optimizers: it rebuilds those when a checkpoint loads."""
    before: list[int] = []

    def widen(opt: Any, args: Any, kwargs: Any) -> None:
        before.append(torch.get_num_threads())
        torch.set_num_threads(threads)

    def restore(opt: Any, args: Any, kwargs: Any) -> None:
        torch.set_num_threads(before.pop())

    optimizer.register_step_pre_hook(widen)
    optimizer.register_step_post_hook(restore)


def cpu_adam_is_fused(hybrid: Any) -> bool:
    return all(group.get("fused") is True for opt in hybrid.cpu_optimizers for group in opt.param_groups)


def use_task_cpus(optimizer: Any, env: Mapping[str, str] | None = None) -> int:
    """Step the CPU Adam of `optimizer` (Megatron's) at the task's CPU count and log it once; returns the count
    (0: no hybrid optimizer, nothing changed)."""
    hybrids = hybrid_optimizers(optimizer)
    if not hybrids:
        return 0
    threads, source = cpu_adam_threads(os.environ if env is None else env, len(os.sched_getaffinity(0)))
    for hybrid in hybrids:
        step_at_threads(hybrid, threads)
    params = sum(p.numel() for h in hybrids for opt in h.cpu_optimizers for g in opt.param_groups for p in g["params"])
    fused = all(cpu_adam_is_fused(h) for h in hybrids)
    log.info(
        "CPU Adam (optimizer.cpu_offload): %s AdamW over %.3gB host parameters, its step at %d threads (%s; the "
        "rest of the process at %d)", "fused" if fused else "UNFUSED", params / 1e9, threads, source,
        torch.get_num_threads(),
    )  # fmt: skip
    if not fused:
        log.warning("this Megatron-Core no longer passes fused=True to its CPU AdamW: ~10x slower steps")
    return threads
