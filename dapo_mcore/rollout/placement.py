"""Where a task's engine shard runs: one pure function of the task's ranks, so that every adapter (and a test
of 8 or 16 tasks on a laptop) agrees on it.

The engine is colocated with the actor: task `rank` (`local_rank` on its node) drives GPU `local_rank`, as
the actor does (parallel/state.py `resolve_device`, slurm/train.sbatch exports LOCAL_RANK=SLURM_LOCALID).
Engine replicas are groups of `tp_size` consecutive ranks: replica `rank // tp_size`, shard `rank % tp_size`
inside it (the sampler splits prompts over replicas the same way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from dapo_mcore.utils.errors import LayoutError

T = TypeVar("T")


@dataclass(frozen=True)
class ReplicaSplit:
    """The replica arithmetic every user of the engines shares (sampler, validator): replica `rank // tp_size`
    of `world_size // tp_size`; items (prompts, groups) dealt round-robin over the replicas; what the ranks
    gather put back in the items' order, one copy per replica (its TP ranks hold the same)."""

    rank: int
    world_size: int
    tp_size: int

    @property
    def replica(self) -> int:
        return self.rank // self.tp_size

    @property
    def n_replicas(self) -> int:
        return self.world_size // self.tp_size

    @property
    def tp_rank(self) -> int:
        """This task's shard of its replica's engine (its rank in the engine's TP group)."""
        return self.rank % self.tp_size

    def mine(self, items: Sequence[T]) -> list[T]:
        """This replica's share of `items`: every n_replicas-th, from its own index."""
        return list(items[self.replica :: self.n_replicas])

    def per_replica(self, gathered: Sequence[T]) -> list[T]:
        """One rank's entry per replica (its first TP rank's) of an all-gather over every rank."""
        return list(gathered[:: self.tp_size])

    def in_order(self, shares: Sequence[Sequence[T]], count: int) -> list[T]:
        """The `count` items whose replica shares (`mine`, in replica order) are `shares`, in their order."""
        n = self.n_replicas
        return [shares[i % n][i // n] for i in range(count)]


@dataclass(frozen=True)
class EnginePlacement(ReplicaSplit):
    local_rank: int = 0
    # The CUDA device of this task's engine shard; None on the CPU.
    device_index: int | None = None


def engine_placement(rank: int, local_rank: int, world_size: int, tp_size: int, device_type: str) -> EnginePlacement:
    if tp_size < 1 or world_size % tp_size:
        raise LayoutError(f"rollout.engine_tp_size={tp_size} does not divide the world size {world_size}")
    if not 0 <= rank < world_size or not 0 <= local_rank <= rank:
        raise LayoutError(f"task RANK={rank} LOCAL_RANK={local_rank} does not fit a world of {world_size} tasks")
    return EnginePlacement(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        tp_size=tp_size,
        device_index=local_rank if device_type == "cuda" else None,
    )
