"""Process groups and the CPU (gloo) mode; the only code that touches megatron.core.parallel_state."""

from dapo_mcore.parallel.liveness import PEER_LOST_EXIT_CODE
from dapo_mcore.parallel.state import (
    ParallelContext,
    StoreBoard,
    all_gather_objects,
    all_to_all_on_host,
    broadcast_object,
    check_layout,
    destroy_parallel,
    init_parallel,
    on_rank0,
    resolve_device,
)

__all__ = [
    "PEER_LOST_EXIT_CODE",
    "ParallelContext",
    "StoreBoard",
    "all_gather_objects",
    "all_to_all_on_host",
    "broadcast_object",
    "check_layout",
    "destroy_parallel",
    "init_parallel",
    "on_rank0",
    "resolve_device",
]
