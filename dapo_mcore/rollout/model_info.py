"""Facts about an HF model directory that every engine adapter checks against, read without loading weights:
the HF-named parameters and their shapes (a weight push must match them) and the end-of-sequence ids."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import torch

from dapo_mcore.utils.errors import CheckpointError


@cache
def hf_weight_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """HF checkpoint name -> shape of every parameter the engine holds (a tied output layer is not listed;
    a mixture-of-experts layer's experts one by one, as checkpoints and weight pushes name them)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(view.shape) for name, view in checkpoint_named_views(model).items()}


def checkpoint_named_views(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters by their checkpoint (hub) names, as views into the parameters. transformers 5
    keeps a MoE layer's experts fused, `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first, as its forward
    chunks them) and `mlp.experts.down_proj` [E, H, I], and maps the per-expert checkpoint names onto them
    when loading; the weights pushed to the engine carry the checkpoint names."""
    views: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        data = param.detach()
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix, half = name.removesuffix("gate_up_proj"), data.shape[1] // 2
            for e in range(data.shape[0]):
                views[f"{prefix}{e}.gate_proj.weight"] = data[e, :half]
                views[f"{prefix}{e}.up_proj.weight"] = data[e, half:]
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(data.shape[0]):
                views[f"{prefix}{e}.down_proj.weight"] = data[e]
        else:
            views[name] = data
    return views


def check_weight(engine: str, shapes: dict[str, tuple[int, ...]], name: str, shape: tuple[int, ...]) -> None:
    """A pushed tensor must be one of the model's parameters with its exact shape."""
    expected = shapes.get(name)
    if expected is None:
        raise CheckpointError(f"{engine} engine: the model has no parameter named '{name}'")
    if tuple(shape) != expected:
        raise CheckpointError(f"{engine} engine: '{name}' has shape {expected}, the update has {tuple(shape)}")


def stop_token_ids(model_path: str, tokenizer_eos_id: int | None) -> list[int]:
    """Every end-of-sequence id the model declares: the tokenizer's, config.json's and generation_config.json's
    (instruct models often list several, e.g. <|im_end|> and <|endoftext|>)."""
    ids: list[int] = [] if tokenizer_eos_id is None else [tokenizer_eos_id]
    for file in ("config.json", "generation_config.json"):
        path = Path(model_path) / file
        if not path.exists():
            continue
        value = json.loads(path.read_text()).get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if token is not None and token not in ids:
                ids.append(int(token))
    return ids
