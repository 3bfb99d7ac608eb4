"""How a full (unsharded) Megatron tensor maps to this rank's tensor-parallel shard, and back.

Megatron marks TP-split parameters with `tensor_model_parallel` and `partition_dim`. Two layouts need care:
- the vocab (embedding, output layer) is padded to `padded_vocab` rows before splitting;
- the SwiGLU fc1 weight holds [gate; up], and each TP shard holds [gate_shard; up_shard].
Global names use the layer's global index (`TransformerLayer.layer_number - 1`) and, in mixture-of-experts
layers, the expert's global index (`MoELayer.local_expert_indices`), so a name means the same parameter at
every pipeline and expert-parallel layout. Expert weights are split over the expert TP group, not TP.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")
# An expert's parameters: SequentialMLP's `local_experts.<j>.` (local spec) or TEGroupedMLP's `weight<j>`.
_LOCAL_EXPERT_RE = re.compile(r"\.mlp\.experts\.(?:local_experts\.(\d+)\.|(linear_fc[12]\.weight)(\d+)$)")
_VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclass(frozen=True)
class TPSplit:
    dim: int | None  # None: replicated over TP ranks
    swiglu: bool = False  # fc1 of a gated MLP: [gate; up], each split separately
    vocab: bool = False  # rows padded to the padded vocab size
    expert: bool = False  # an expert's weight: split over the expert TP group


def is_expert_param(name: str) -> bool:
    return ".mlp.experts." in name


def tp_split_of(name: str, param: torch.Tensor) -> TPSplit:
    if not getattr(param, "tensor_model_parallel", False):
        return TPSplit(dim=None)
    swiglu = re.search(r"mlp\.(experts\.(local_experts\.\d+\.)?)?linear_fc1\.weight\d*$", name) is not None
    return TPSplit(dim=param.partition_dim, swiglu=swiglu, vocab=name in _VOCAB_PARAMS, expert=is_expert_param(name))


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module


def global_named_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(name with global layer index, parameter) for every parameter this rank holds."""
    model = unwrap(model)
    layers = model.decoder.layers if hasattr(model, "decoder") else []
    for name, param in model.named_parameters():
        match = _LAYER_RE.match(name)
        if match:
            layer = layers[int(match.group(1))]
            name = f"decoder.layers.{layer.layer_number - 1}.{name[match.end() :]}"
            name = _global_expert_name(name, layer)
        yield name, param


def _global_expert_name(name: str, layer: torch.nn.Module) -> str:
    """An expert parameter's name with its global expert index in place of the local one."""
    match = _LOCAL_EXPERT_RE.search(name)
    if not match:
        return name
    if match.group(1) is not None:  # local_experts.<j>.
        expert = layer.mlp.local_expert_indices[int(match.group(1))]
        return f"{name[: match.start(1)]}{expert}{name[match.end(1) :]}"
    expert = layer.mlp.local_expert_indices[int(match.group(3))]
    return f"{name[: match.start(3)]}{expert}"


def shard_of(full: torch.Tensor, split: TPSplit, tp_rank: int, tp_size: int, padded_vocab: int) -> torch.Tensor:
    """This rank's shard of a full tensor (the inverse of gather_full)."""
    if split.dim is None:
        return full
    if split.vocab and full.shape[0] < padded_vocab:
        pad = full.new_zeros((padded_vocab - full.shape[0], *full.shape[1:]))
        full = torch.cat([full, pad], dim=0)
    if split.swiglu:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)
    return full.chunk(tp_size, dim=split.dim)[tp_rank]


def gather_full(local: torch.Tensor, split: TPSplit, tp_group, true_vocab: int) -> torch.Tensor:
    """The full tensor from every TP rank's shard (vocab padding removed). Collective over tp_group."""
    if split.dim is None:
        return local
    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    shards = [local]
    if tp_size > 1:
        shards = [torch.empty_like(local) for _ in range(tp_size)]
        dist.all_gather(shards, local.contiguous(), group=tp_group)
    if split.swiglu:
        halves = [s.chunk(2, dim=0) for s in shards]
        full = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    else:
        full = torch.cat(shards, dim=split.dim)
    return full[:true_vocab] if split.vocab else full
