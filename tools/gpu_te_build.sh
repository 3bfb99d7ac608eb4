#!/usr/bin/env bash
# Here, with the index and no GPU: build Transformer Engine's PyTorch extension (transformer_engine_torch) for
# a GPU machine's Python 3.12 and torch, so that the machine unpacks it instead of compiling it for 5 minutes
# of its device time (tools/gpu_install.sh te unpacks .whl/transformer_engine_torch-*-built-*.tgz).
#
#   bash tools/gpu_te_build.sh              after tools/gpu_wheels.sh --te (the source is .whl/*.tar.gz)
#
# The extension is a C++ one (torch's CppExtension, g++ only: TE's CUDA kernels are in the core wheel), so it
# needs the CUDA headers, not a GPU: they come from NVIDIA's wheels (nvcc, crt, cccl of the CUDA that torch was
# built with, cuDNN's frontend). It must be built against the very torch the machine has: TE_TORCH (default
# 2.11.0, whose wheel on the index is the CUDA 13.0 build the GPU machine has). About 15 minutes on 2 cores.
# The venv is kept in ~/.cache/dapo-mcore/te-build-py312 for the next build. If the machine cannot load what was
# built here (an older glibc or libstdc++ there), `gpu_install.sh te` says so and compiles there instead.
set -euo pipefail
cd "$(dirname "$0")/.."
TE_TORCH=${TE_TORCH:-2.11.0}
CUDA_PINS=("nvidia-cuda-nvcc>=13.0,<13.1" "nvidia-cuda-crt>=13.0,<13.1" "nvidia-cuda-cccl>=13.0,<13.1")
sdist=$(ls .whl/transformer_engine_torch-*.tar.gz 2>/dev/null | head -1 || true)
[[ -n "$sdist" ]] || { echo "no .whl/transformer_engine_torch-*.tar.gz: run tools/gpu_wheels.sh --te first" >&2; exit 2; }
py312=""
for candidate in "${PYTHON312:-}" python3.12 ~/.pyenv/versions/3.12*/bin/python3.12; do  # a pyenv shim may not run
  if [[ -n "$candidate" ]] && "$candidate" -c '' 2>/dev/null; then py312=$candidate; break; fi
done
[[ -n "$py312" ]] || { echo "a Python 3.12 is needed (the GPU machine's): set PYTHON312" >&2; exit 2; }
venv=${DAPO_TE_BUILD_VENV:-$HOME/.cache/dapo-mcore/te-build-py312}
uv=$(command -v uv || ls .venv/bin/uv 2>/dev/null || true)
if [[ ! -x "$venv/bin/python" ]]; then
  if [[ -n "$uv" ]]; then "$uv" venv -q -p "$py312" "$venv"; else "$py312" -m venv "$venv"; fi
fi
packages=("torch==$TE_TORCH" "${CUDA_PINS[@]}" nvidia-cudnn-frontend setuptools wheel packaging pybind11 ninja numpy pip)
if [[ -n "$uv" ]]; then VIRTUAL_ENV=$venv "$uv" pip install -q "${packages[@]}"; else "$venv/bin/pip" install -q "${packages[@]}"; fi
"$venv/bin/python" -c 'import torch; print("building against torch", torch.__version__, "CUDA", torch.version.cuda)'
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
start=$SECONDS
# NVTE_BUILD_USE_NVIDIA_WHEELS: the headers from the wheels above, not a CUDA toolkit; the setup's attempt to
# download a prebuilt wheel fails without network to GitHub and it compiles, as wanted
NVTE_BUILD_USE_NVIDIA_WHEELS=1 NVTE_CUDA_ARCHS=90 NVTE_FRAMEWORK=pytorch MAX_JOBS="$(nproc)" \
  VIRTUAL_ENV=$venv PATH="$venv/bin:$PATH" "$venv/bin/python" -m pip wheel -q --no-index --no-deps \
  --no-build-isolation --no-cache-dir -w "$tmp/wheel" "$sdist"
echo "compiled in $((SECONDS - start)) s"
# the te-keep layout: the files of the installed package, relative to site-packages
"$venv/bin/python" -m pip install -q --no-index --no-deps --target "$tmp/site" "$tmp"/wheel/*.whl
te=$(basename "$sdist" .tar.gz | sed 's/^transformer_engine_torch-//')
torch_tag=$("$venv/bin/python" -c 'import torch; print(torch.__version__.replace("+", "-"))')
out=".whl/transformer_engine_torch-$te-built-torch$torch_tag.tgz"
(cd "$tmp/site" && tar czf "$OLDPWD/$out" $(cut -d, -f1 "transformer_engine_torch-$te.dist-info/RECORD"))
# what the machine's C libraries must offer: the newest glibc and libstdc++ symbol versions it uses
so=$(find "$tmp/site" -name "transformer_engine_torch*.so" | head -1)
echo "needs $(objdump -T "$so" | grep -o 'GLIBC_[0-9.]*' | sort -V | tail -1)" \
  "and $(objdump -T "$so" | grep -o 'GLIBCXX_[0-9.]*' | sort -V | tail -1)"
ls -la "$out"
