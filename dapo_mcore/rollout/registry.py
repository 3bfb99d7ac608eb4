"""Engines by name, imported only when asked for (vllm and sglang are optional, GPU-only extras).

Each adapter class offers `create(model_path=..., device=..., dtype=..., load_weights=...)`.
"""

from __future__ import annotations

import importlib
from typing import Any

from dapo_mcore.rollout.base import RolloutEngine
from dapo_mcore.utils.errors import ConfigError

_ADAPTERS = {
    "hf": ("dapo_mcore.rollout.hf_engine", "HFEngine", "transformers"),
    "vllm": ("dapo_mcore.rollout.vllm_engine", "VLLMEngine", "vllm"),
    "sglang": ("dapo_mcore.rollout.sglang_engine", "SGLangEngine", "sglang"),
}


def create_engine(name: str, **kwargs: Any) -> RolloutEngine:
    if name not in _ADAPTERS:
        raise ConfigError(f"rollout.engine must be one of {sorted(_ADAPTERS)}, got {name!r}")
    module_name, class_name, package = _ADAPTERS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise ConfigError(
            f"rollout.engine={name} needs the '{package}' package ({err}); "
            f"install it with: pip install 'dapo-mcore[{name}]'"
        ) from None
    return getattr(module, class_name).create(**kwargs)
