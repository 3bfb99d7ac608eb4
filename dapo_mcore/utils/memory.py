"""Memory in use, for the per-phase memory metrics: the whole GPU's on CUDA (the engine allocates outside
torch's caching allocator, so torch's own counters would miss it), this process's resident set on the CPU."""

from __future__ import annotations

import psutil
import torch


def release_cached_blocks(device: torch.device) -> None:
    """Hand the blocks PyTorch's caching allocator holds but no tensor uses back to the driver (CUDA; nothing to
    do on the CPU): an engine allocates through its own pool, so cached blocks would count against it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def memory_in_use_gb(device: torch.device) -> float:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return (total - free) / 2**30
    return psutil.Process().memory_info().rss / 2**30
