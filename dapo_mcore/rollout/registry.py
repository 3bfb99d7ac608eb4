"""Engines by name, imported only when asked for (vllm and sglang are optional extras).

Each adapter class offers `create(settings: EngineSettings)`; the engine it returns is wrapped so that any
failure inside it stops the run with one message naming the engine (rollout/guard.py).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path
from typing import Any

import torch

from dapo_mcore.rollout.base import EngineSettings, RolloutEngine
from dapo_mcore.rollout.guard import GuardedEngine
from dapo_mcore.rollout.synthetic_engine import SyntheticSettings
from dapo_mcore.rollout.vllm_compat import WINDOW_TEXT, installed, version_problem
from dapo_mcore.utils.errors import ConfigError
from dapo_mcore.utils.install import install_hint

# name -> (module, class, the package it needs, how to install that package)
_ADAPTERS = {
    "hf": ("dapo_mcore.rollout.hf_engine", "HFEngine", "transformers", "pip install -e . in the project's checkout"),
    "vllm": (
        "dapo_mcore.rollout.vllm_engine",
        "VLLMEngine",
        "vllm",
        f"{install_hint('vllm')}; a vLLM {WINDOW_TEXT} built for your torch; on a machine without CUDA: make setup",
    ),
    "sglang": ("dapo_mcore.rollout.sglang_engine", "SGLangEngine", "sglang", install_hint("sglang")),
    # no model: answers drawn at once, for scale rehearsals and tests only (docs/engines.md)
    "synthetic": (
        "dapo_mcore.rollout.synthetic_engine",
        "SyntheticEngine",
        "transformers",
        "pip install -e . in the project's checkout",
    ),  # fmt: skip
}
# Engines that generate with a model; the synthetic one is named apart in the unknown-name message.
_MODEL_ENGINES = ("hf", "sglang", "vllm")


def engine_problem(name: str, device: str, model_config: dict[str, Any]) -> str | None:
    """Why `create_engine(name, ...)` would refuse to start for this model on `device` ("cpu" / "cuda"), found
    without importing the engine: an unknown name, its package missing, or a model it cannot serve there."""
    if name not in _ADAPTERS:
        return (
            f"rollout.engine must be one of {sorted(_MODEL_ENGINES)} (or 'synthetic': no model, for rehearsals and "
            f"tests), got {name!r}"
        )
    _, _, package, install = _ADAPTERS[name]
    if importlib.util.find_spec(package) is None:
        return f"rollout.engine={name} needs the '{package}' package: {install}"
    if name == "vllm" and (problem := version_problem(installed())):
        return problem
    is_moe = bool(model_config.get("num_experts") or model_config.get("num_local_experts"))
    if name == "vllm" and device == "cpu" and is_moe:
        # vLLM's CPU build prepacks an MoE layer's experts when it loads them, and its in-place reload (every
        # weight push) does not bring that back right: log-probs 13.7 nats off (tests/engines/test_engine_contract.py)
        return (
            "rollout.engine=vllm on the CPU cannot take weight pushes into a mixture-of-experts model's experts "
            "(vLLM's CPU MoE kernels; docs/engines.md): use rollout.engine=hf or sglang on the CPU"
        )
    return None


def create_engine(name: str, settings: EngineSettings, synthetic: SyntheticSettings | None = None) -> RolloutEngine:
    """The engine `name`, started. `synthetic`: the synthetic engine's knobs (SyntheticSettings.of(config's
    rollout.synthetic, trainer.steps)); None: their defaults. Other engines take none."""
    problem = engine_problem(name, torch.device(settings.device).type, _model_config(settings.model_path))
    if problem:
        raise ConfigError(problem)
    module_name, class_name, _, _ = _ADAPTERS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise  # a dependency of the engine package itself is missing: its own traceback says which
        raise ConfigError(f"rollout.engine={name}: this version has no {name} adapter yet (docs/engines.md)") from None
    adapter = getattr(module, class_name)
    if name == "synthetic":
        return GuardedEngine(name, lambda: adapter.create(settings, synthetic))
    return GuardedEngine(name, lambda: adapter.create(settings))


def _model_config(model_path: str) -> dict[str, Any]:
    """The model's config.json, or {} where there is none yet (the engine's own start names that problem)."""
    path = Path(model_path) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


# The SGLang release the adapter is tested with (docs/engines.md, "Versions"); vLLM's window is vllm_compat's.
SGLANG_TESTED = "0.5.23"


def engine_version(name: str) -> str | None:
    """The installed engine package and its version, and whether the adapter is tested with it (metadata only,
    nothing imported); None for an engine without a package of its own or one not installed."""
    if name == "vllm":
        found = installed()
        return None if found is None else f"vLLM: {found.describe()}"
    if name != "sglang":
        return None
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None
    where = (
        "the tested version" if version == SGLANG_TESTED else f"untested: the adapter is tested with {SGLANG_TESTED}"
    )
    return f"SGLang: sglang {version} ({where})"
