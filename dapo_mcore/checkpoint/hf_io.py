"""Streaming HF safetensors I/O: read one tensor at a time, load into this rank's Megatron shards."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dapo_mcore.checkpoint.convert import LlamaFamilyMap
from dapo_mcore.mcore.provider import padded_vocab_size
from dapo_mcore.mcore.sharding import global_named_parameters, shard_of, tp_split_of
from dapo_mcore.utils.errors import CheckpointError


class SafetensorsReader:
    """Lazy access to the tensors of an HF directory (single file or sharded with an index)."""

    def __init__(self, hf_dir: str | Path):
        from safetensors import safe_open

        self.hf_dir = Path(hf_dir)
        index = self.hf_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.hf_dir / "model.safetensors").is_file():
            with safe_open(self.hf_dir / "model.safetensors", framework="pt") as fh:
                weight_map = {k: "model.safetensors" for k in fh.keys()}  # noqa: SIM118 (not a dict)
        else:
            raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {self.hf_dir}")
        self.weight_map: dict[str, str] = weight_map
        self._open = safe_open

    def names(self) -> list[str]:
        return list(self.weight_map)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise CheckpointError(f"{self.hf_dir}: tensor '{name}' is missing from the checkpoint")
        path = self.hf_dir / self.weight_map[name]
        if not path.is_file():
            raise CheckpointError(f"{self.hf_dir}: shard file {path.name} (holding '{name}') is missing")
        with self._open(path, framework="pt") as fh:
            return fh.get_tensor(name)


@torch.no_grad()
def load_hf_weights(
    model_chunks: list[torch.nn.Module], hf_dir: str | Path, family: LlamaFamilyMap, tp_rank: int, tp_size: int
) -> None:
    """Copy the HF checkpoint's weights into this rank's Megatron shards, one parameter at a time."""
    reader = SafetensorsReader(hf_dir)
    padded = padded_vocab_size(family.spec.vocab_size, tp_size)
    for chunk in model_chunks:
        for name, param in global_named_parameters(chunk):
            full = family.hf_to_mcore(name, [reader.get(n) for n in family.hf_sources(name)])
            local = shard_of(full, tp_split_of(name, param), tp_rank, tp_size, padded)
            if local.shape != param.shape:
                raise CheckpointError(
                    f"{hf_dir}: '{name}' gives a shard of shape {tuple(local.shape)}, the model "
                    f"expects {tuple(param.shape)} (does config.json match the weights?)"
                )
            param.copy_(local.to(param.dtype))
