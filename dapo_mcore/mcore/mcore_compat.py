"""Megatron-Core's version layer: every place the project patches Megatron-Core or calls a private part of it,
with the releases each was checked on, as rollout/vllm_compat.py does for vLLM.

The tested window is WINDOW (pyproject.toml pins the same: megatron-core>=0.16.1,<0.20). "Checked on" below:
0.16.1 runs every test (the CPU suite, Python 3.11); 0.19.2 runs on Python 3.12 (0.17+ need it) in an environment
of its own: tests/dist/test_mcore_window.py in every `make test` (the actor's layouts, a save resumed at another
layout and one killed and resumed exactly, the HF round trip of a dense and a MoE model, CLI runs), and once by
hand, 2026-11-29, the unit tier and the dist/e2e/faults modules about MoE, offload and checkpoints (docs/versions.md
has what failed there and why). "source": 0.17.1 and 0.18.2 read from their wheels, not run. A release outside the
window is warned about once at start (check_version), not refused: users' containers choose their Megatron-Core;
`dapo-mcore check` names it (dapo_mcore/versions.py).

The patches and private calls (grep for these names; each says why where it lives):
- mcore/provider.py `_megatron_moe_without_te`: the router tests `te_general_gemm is not None`, a name moe_utils
  defines only when Transformer Engine imports; defined as None (checked on 0.16.1, 0.19.2; the same test in
  0.17.1 and 0.18.2, source).
- mcore/moe.py `install_router_hook`: each TopKRouter's `router_replay` hook (Megatron's own interface), and its
  `routing`, `is_aux_loss_enabled` and `apply_z_loss` shadowed per instance so that a micro-batch's "no router
  losses" travels with it into its recompute (TopKRouter.routing calls them in that order: checked on 0.16.1,
  0.19.2).
- mcore/fused_logprobs.py `install_passthrough_head`: the output layer's forward replaced to hand back hidden
  states (ColumnParallelLinear.forward's signature: checked on 0.16.1, 0.19.2).
- checkpoint/optimizer_format.py `adam_step_fixed`: the distributed optimizer's
  `_set_main_param_and_optimizer_states` wrapped at load (the shared Adam `step`: checked on 0.16.1, 0.19.2).
- checkpoint/writer_processes.py: the write-results queue's manager (filesystem_async._results_queue) and the forked
  writers of the torch_dist strategy (FileSystemWriterAsync: checked on 0.16.1, 0.19.2; 0.17+ reach it only with
  async_strategy="mcore", see save_in_background).
- mcore/cpu_adam.py: the hybrid optimizer's `cpu_optimizers`, and its step run at the task's CPUs through torch's
  step hooks (built with fused=True: checked on 0.16.1, 0.19.2; tests/unit/test_cpu_adam.py checks that).
- here, `sync_offloaded_optimizer_after_load`: the hybrid optimizer's `_sync_hdo_state_to_sub_optimizers`
  (checked on 0.16.1, 0.19.2).
- here, `save_files_problem`: common.pt, where dist_checkpointing keeps a save's common state until 0.18 (0.16.1;
  0.17.1 and 0.18.2 source); 0.19.2 keeps it inside the shards and writes no common.pt (it still reads one).
- here, `save_in_background`: dist_checkpointing.save's async_strategy, from 0.17 on (0.17.1, 0.18.2 source; 0.19.2),
  by default "nvrx" (nvidia-resiliency-ext, not installed with Megatron-Core); 0.16.1 has no such argument.
- here, `cpu_rope_cp_slice`: `get_pos_emb_on_this_cp_rank` (models/common/embeddings/rope_utils.py, imported by name
  into rotary_pos_embedding.py and yarn_rotary_pos_embedding.py) replaced in the CPU mode at CP > 1: it builds its
  index with pin_memory=True, which a CPU-only torch refuses (checked on 0.16.1).
- mcore/cp_attention.py: `gather_from_sequence_parallel_region` with the CP group (tensor_parallel/mappings.py; its
  backward reduce-scatters) and DotProductAttention's constructor/forward signature (the CoreAttentionBuilder and
  CoreAttention protocols of transformer/attention.py), substituted in the local spec at CP > 1 (checked on 0.16.1).
- here, `NOTICES` (quiet_notices) and parallel/state.py's _BENIGN_WARNINGS: what 0.17-0.19 log or warn on every run
  that says nothing about it (checked on 0.19.2; the releases each line came in beside it).
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Collection
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


def in_window(version: str) -> bool:
    return WINDOW[0] <= release_of(version) < WINDOW[1]


def describe_installed() -> str:
    """'megatron-core 0.19.2 (inside the tested window 0.16 to 0.19)', or that it is not installed (metadata only:
    Megatron-Core is not imported)."""
    version = installed_version()
    if version is None:
        return "no megatron-core"
    return f"megatron-core {version} ({'inside' if in_window(version) else 'outside'} the tested window {WINDOW_TEXT})"


def check_version() -> None:
    """Warn once where the installed Megatron-Core is outside the tested window (its patches may not fit)."""
    version = installed_version()
    if version is not None and not in_window(version):
        log.warning("megatron-core %s is outside the tested window %s: the patches listed in "
                    "dapo_mcore/mcore/mcore_compat.py were not checked on it", version, WINDOW_TEXT)  # fmt: skip


# ----- notices ---------------------------------------------------------------------------------------------------
# Lines Megatron-Core logs (at WARNING, through loggers no handler is set up for: Python prints them on stderr) on
# every run that say nothing about the run: (logger, the message's start, the releases that log it, checked).
NOTICES = (
    # 0.19.2: a deprecation of the class the project builds its models with (HybridModel is not a drop-in)
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED", "0.19.2"),
    # 0.18.2 (source), 0.19.2: the distributed optimizer's layout, computed by DDP as before when not passed in
    ("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel: full_param_layout not provided",
     "0.18.2, 0.19.2"),
    # 0.17.1, 0.18.2 (source), 0.19.2: the background writer the project chooses (save_in_background)
    ("megatron.core.dist_checkpointing.strategies.torch", "MCore's async save is deprecated", "0.17.1 to 0.19.2"),
)  # fmt: skip


class _DropNotice(logging.Filter):
    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


def quiet_notices() -> None:
    """Drop the NOTICES lines (idempotent; Megatron-Core need not be imported yet: the filters sit on its loggers by
    name). Called where the model is built and before a background save."""
    for name, start, _ in NOTICES:
        megatron_logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNotice) and f.start == start for f in megatron_logger.filters):
            megatron_logger.addFilter(_DropNotice(start))


# ----- context parallelism on the CPU ------------------------------------------------------------------------------
def _pos_emb_on_this_cp_rank(pos_emb: Any, seq_dim: int, cp_group: Any) -> Any:
    """Megatron-Core's get_pos_emb_on_this_cp_rank (rope_utils.py) without pinned memory: the positions of chunks
    cp_rank and 2 cp_size - 1 - cp_rank of 2 cp_size along seq_dim (the same view and index_select)."""
    import torch

    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[(seq_dim + 1) :])
    pos_emb = pos_emb.index_select(seq_dim, cp_idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[(seq_dim + 2) :])


def cpu_rope_cp_slice() -> None:
    """Install _pos_emb_on_this_cp_rank where Megatron-Core looks the name up (idempotent). Its own builds the index
    with `torch.tensor(..., device="cpu", pin_memory=True)`, which raises on a CPU-only torch ("pin_memory=True
    requires a CUDA or other accelerator backend"): every RoPE model at CP > 1 in the CPU mode failed there. Only
    for the CPU: on a GPU Megatron's own stays (checked on 0.16.1)."""
    import importlib

    for name in ("rope_utils", "rotary_pos_embedding", "yarn_rotary_pos_embedding"):
        module = importlib.import_module(f"megatron.core.models.common.embeddings.{name}")
        if hasattr(module, "get_pos_emb_on_this_cp_rank"):
            module.get_pos_emb_on_this_cp_rank = _pos_emb_on_this_cp_rank


# ----- distributed checkpoints ---------------------------------------------------------------------------------
# The release from which dist_checkpointing keeps a save's common (non-sharded) state as the ShardedObject
# "common_state" inside the torch_dist shards instead of in a file of its own, common.pt (0.16.1, 0.17.1, 0.18.2
# write common.pt; 0.19.2 does not, and still reads it in older saves).
COMMON_STATE_IN_SHARDS = (0, 19)


def save_files_problem(listed: Collection[str]) -> str | None:
    """What is wrong with a Megatron-Core distributed checkpoint whose manifest lists `listed`, for the installed
    release, or None: metadata.json and torch_dist's .metadata always, and common.pt before 0.19 (checked on 0.16.1,
    0.19.2; 0.17.1 and 0.18.2 read from their source). A save without common.pt but with the others was written by
    0.19 or later, which a release before it cannot read (without Megatron-Core, e.g. `checkpoint verify` on a login
    node, both forms are complete)."""
    for needed in ("metadata.json", ".metadata"):
        if needed not in listed:
            return f"has no {needed}: not a complete distributed checkpoint"
    version = installed_version()
    if "common.pt" not in listed and version is not None and release_of(version) < COMMON_STATE_IN_SHARDS:
        return (
            "has no common.pt: written by Megatron-Core 0.19 or later (which keeps the common state inside the "
            f"shards), megatron-core {version} cannot read it; install megatron-core>=0.19 to read it"
        )
    return None


def save_in_background(state: dict[str, Any], path: str, strategy: Any) -> Any:
    """dist_checkpointing.save of `state` with its shards written by Megatron-Core's own background writer
    (FileSystemWriterAsync, whose processes checkpoint/writer_processes.py ties to the run); the AsyncRequest to
    schedule. From 0.17 save() takes async_strategy, by default "nvrx" (nvidia-resiliency-ext's writer, which
    raises ModuleNotFoundError without that package): "mcore" keeps the writer 0.16 had (checked on 0.16.1, which
    has no such argument, and 0.19.2; 0.17.1 and 0.18.2 read from their source)."""
    import inspect

    from megatron.core import dist_checkpointing

    quiet_notices()  # 0.17+ call the "mcore" writer deprecated
    options: dict[str, Any] = {"validate_access_integrity": False, "async_sharded_save": True}
    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        options["async_strategy"] = "mcore"
    return dist_checkpointing.save(state, path, strategy, **options)


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
