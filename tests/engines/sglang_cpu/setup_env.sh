#!/usr/bin/env bash
# Builds SGLang's CPU *test* environment (see docs/engines.md): a venv of its own, never the main .venv and
# never what users install. sglang==0.5.23 pins a CUDA torch and a CUDA-only sgl-kernel; here it goes in
# with --no-deps beside torch==2.13.0+cpu, with its non-CUDA dependencies (requirements.txt) under a
# constraint that keeps that torch, plus the start-up bridge (dapo_sglang_cpu_bridge.py, loaded by a .pth).
#
#   tests/engines/sglang_cpu/setup_env.sh [VENV]     (default: ~/.cache/dapo-mcore/sglang-cpu, outside any clone)
#
# Rebuilt only when this script, requirements.txt or the bridge changed (tests/engines/cached_env.sh: a stamp holds
# their hash): a fresh clone reuses the environment an earlier clone built (about 2 minutes saved).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/dapo-mcore/sglang-cpu}"
source "$here/../cached_env.sh"
want="$(cat "$here/setup_env.sh" "$here/../cached_env.sh" "$here/requirements.txt" "$here/dapo_sglang_cpu_bridge.py" |
  sha256sum | cut -d' ' -f1)"
reuse_or_clear "$venv" "$want"
"${PYTHON:-python3}" -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q)
"${pip[@]}" --upgrade pip
"${pip[@]}" torch==2.13.0
constraint="$(mktemp)"
echo "torch==2.13.0" >"$constraint"
"${pip[@]}" --no-deps sglang==0.5.23
"${pip[@]}" -r "$here/requirements.txt" -c "$constraint" pytest
rm -f "$constraint"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cp "$here/dapo_sglang_cpu_bridge.py" "$site/"
echo "import dapo_sglang_cpu_bridge" >"$site/dapo_sglang_cpu_bridge.pth"
stamp_env "$venv" "$want"
