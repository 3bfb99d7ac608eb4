"""An RMSNorm for Megatron's local (non-TE) layer spec that works with sequence parallelism.

Megatron-Core's fallback `WrappedTorchNorm` refuses sequence_parallel=True. Under sequence parallelism
each TP rank normalises its own slice of the sequence, so a norm weight's gradient is partial per rank.
Apex and TE norms mark the weight `sequence_parallel`, and Megatron's finalize_model_grads then sums
those gradients over TP. This class does the same with torch's RMSNorm. Only the CPU path (no TE, no
apex) needs it; with TE, its own norms are used.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)


def with_sequence_parallel_norms(layer_spec: Any, torch_norm: type) -> Any:
    """A copy of a local layer spec with every `torch_norm` submodule replaced by SequenceParallelRMSNorm."""
    spec = copy.deepcopy(layer_spec)
    _replace(spec, torch_norm)
    return spec


def _replace(node: Any, torch_norm: type) -> None:
    submodules = getattr(node, "submodules", None)
    if submodules is None:
        return
    for name, value in vars(submodules).items():
        if value is torch_norm:
            setattr(submodules, name, SequenceParallelRMSNorm)
        else:
            _replace(value, torch_norm)
