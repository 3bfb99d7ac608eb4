"""Checksums that travel with the weight buckets, so an engine never loads bytes that differ from the actor's.

The stage that owns a tensor checksums it right after the TP gather and the HF renaming; the checksums go
with the bucket to every rank; each tensor is checked again at the moment the engine takes it. A mismatch
(a damaged broadcast, a buffer reused too early, a bug in a transfer path) names the first tensor that differs.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from dapo_mcore.utils.errors import CheckpointError

_MASK = (1 << 62) - 1


def tensor_checksum(tensor: torch.Tensor) -> int:
    """A position-weighted sum of the tensor's 32-bit words, on the tensor's own device (no host copy).

    Integer sums wrap modulo 2**64 whatever the reduction order, so the value is exact and repeatable; a
    changed, swapped or moved word changes it."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if data.numel() % 4:
        data = torch.cat([data, data.new_zeros(4 - data.numel() % 4)])
    words = data.view(torch.int32).to(torch.int64)
    weights = torch.arange(1, words.numel() + 1, device=words.device, dtype=torch.int64) % 65521 + 1
    return int((words * weights).sum().item()) & _MASK


def checksums(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[int]:
    return [tensor_checksum(t) for _, t in named_tensors]


def verified(
    named_tensors: Iterable[tuple[str, torch.Tensor]], expected: list[int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the tensors, each checked against its expected checksum at the moment it is taken."""
    for (name, tensor), want in zip(named_tensors, expected, strict=True):
        got = tensor_checksum(tensor)
        if got != want:
            raise CheckpointError(
                f"weight sync: '{name}' differs from the actor's (checksum {got:#x}, expected {want:#x}); "
                "the engine was not given it"
            )
        yield name, tensor
