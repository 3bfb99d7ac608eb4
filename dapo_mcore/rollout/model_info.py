"""Facts about an HF model directory that every engine adapter checks against, read without loading weights:
the HF-named parameters and their shapes (a weight push must match them) and the end-of-sequence ids."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from dapo_mcore.utils.errors import CheckpointError


@cache
def hf_weight_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every parameter the engine holds (a tied output layer is not listed)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(param.shape) for name, param in model.named_parameters()}


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
