#!/usr/bin/env bash
# Builds the Megatron-Core test environment at the new end of the supported window (docs/versions.md): a venv of its
# own beside the main .venv (megatron-core 0.16.1 on Python 3.11), from Python 3.12 (megatron-core 0.17+ need it),
# holding the project's dependencies with that megatron-core. Used by tests/dist/test_mcore_window.py; never what
# users install.
#
#   tests/dist/mcore_window/setup_env.sh VENV PYTHON MEGATRON_CORE_VERSION TORCH_VERSION
#
# Only the dependencies, not the project: the tests put the clone that runs them on PYTHONPATH, so that a fresh
# clone reuses this environment (an editable install would point at the clone that built it). torch: the machine's
# CPU wheel is for Python 3.11 only, so the index's build comes in (2.13.0+cu130, which runs on the CPU; its CUDA
# libraries make it about 3 GB). uv installs from its cache (~/.cache/uv, shared with .venv): the first build
# downloads, later ones take seconds. Rebuilt only when this script, the versions or pyproject.toml changed
# (tests/engines/cached_env.sh: a stamp holds their hash; builds wait for each other).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
venv="$1" python="$2" mcore_version="$3" torch_version="$4"
uv="${UV:-$(command -v uv)}"
source "$repo/tests/engines/cached_env.sh"
want="$( (cat "$here/setup_env.sh" "$repo/tests/engines/cached_env.sh" "$repo/pyproject.toml"
  echo "$python $mcore_version $torch_version") | sha256sum | cut -d' ' -f1)"
reuse_or_clear "$venv" "$want"
"$uv" venv -q --python "$python" "$venv"
constraint="$(mktemp)"
trap 'rm -f "$constraint"' EXIT
printf 'torch==%s\nmegatron-core==%s\n' "$torch_version" "$mcore_version" >"$constraint"
"$uv" pip install -q --python "$venv/bin/python" -c "$constraint" "torch==$torch_version" \
  "megatron-core==$mcore_version" -r "$repo/pyproject.toml" --extra dev
"$venv/bin/python" -c "import torch, megatron.core as m; print('torch', torch.__version__, 'megatron-core', m.__version__)"
stamp_env "$venv" "$want"
