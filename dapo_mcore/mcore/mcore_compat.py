"""Megatron-Core's version layer: every place the project patches Megatron-Core or calls a private part of it,
with the release each was written against and checked on, as rollout/vllm_compat.py does for vLLM.

The tested window is WINDOW. Checked on: 0.16.1 (every test, the CPU suite on Python 3.11) and, for the demo's
steps and a TP-2 run only, 0.19.2 on Python 3.12 (ENVIRONMENT.md, 2026-11-29). A release outside the window is
warned about once at start (check_version), not refused: users' containers choose their Megatron-Core.

The patches and private calls (grep for these names; each says why where it lives):
- mcore/provider.py `_megatron_moe_without_te`: 0.16's router tests `te_general_gemm is not None`, a name
  moe_utils defines only when Transformer Engine imports; defined as None (checked on 0.16.1).
- mcore/moe.py `install_router_hook`: each TopKRouter's `router_replay` hook (Megatron's own interface), and its
  `routing`, `is_aux_loss_enabled` and `apply_z_loss` shadowed per instance so that a micro-batch's "no router
  losses" travels with it into its recompute (0.16.1's TopKRouter.routing calls them in that order).
- mcore/fused_logprobs.py `install_passthrough_head`: the output layer's forward replaced to hand back hidden
  states (0.16.1's ColumnParallelLinear.forward signature).
- checkpoint/optimizer_format.py `adam_step_fixed`: the distributed optimizer's
  `_set_main_param_and_optimizer_states` wrapped at load (0.16.1's shared Adam `step`).
- checkpoint/writer_processes.py: the write-results queue's manager and the forked writers of the torch_dist
  strategy (0.16.1's FileSystemWriterAsync).
- mcore/cpu_adam.py: the hybrid optimizer's `cpu_optimizers`, and its step run at the task's CPUs through torch's
  step hooks (0.16.1 builds it with fused=True; tests/unit/test_cpu_adam.py checks that).
- here, `sync_offloaded_optimizer_after_load`: the hybrid optimizer's `_sync_hdo_state_to_sub_optimizers`.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from dapo_mcore.utils.logging import get_logger

log = get_logger(__name__)

# The Megatron-Core releases the project is tested with: [first, end) as (major, minor) pairs.
WINDOW = ((0, 16), (0, 20))
WINDOW_TEXT = "0.16 to 0.19"


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def release_of(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '0.16.1' or '0.19.0rc1'."""
    major, minor = (version.split("+")[0].split(".") + ["0"])[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def check_version() -> None:
    """Warn once where the installed Megatron-Core is outside the tested window (its patches may not fit)."""
    version = installed_version()
    if version is not None and not WINDOW[0] <= release_of(version) < WINDOW[1]:
        log.warning("megatron-core %s is outside the tested window %s: the patches listed in "
                    "dapo_mcore/mcore/mcore_compat.py were not checked on it", version, WINDOW_TEXT)  # fmt: skip


def sync_offloaded_optimizer_after_load(optimizer: Any) -> int:
    """After a load into a distributed optimizer with optimizer.cpu_offload (Megatron's HybridDeviceOptimizer
    under it): hand the loaded state to the hybrid optimizer's sub-optimizers, which step the host copies.

    0.16.1's loaders put the loaded tensors into the hybrid optimizer's `state` as new objects
    (`_set_main_param_and_optimizer_states`' precision-aware branch); its fully_reshardable and fs_model_space
    loaders then call `_sync_hdo_state_to_sub_optimizers`, but `load_parameter_state_from_dp_reshardable` (the
    default format) does not: the CPU Adam kept the fresh run's moments and master weights, and the first update
    after a resume wrote those weights back. The sync is idempotent, so it is called after every load. Returns
    how many hybrid optimizers were synced."""
    synced = 0
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if hasattr(inner, "_sync_hdo_state_to_sub_optimizers"):
            inner._sync_hdo_state_to_sub_optimizers()
            synced += 1
    return synced
