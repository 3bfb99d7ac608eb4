#!/usr/bin/env bash
# On the GPU machine (no network), after tools/gpu_wheels.sh here and the carrying calls of docs/gpu.md:
#
#   bash tools/gpu_install.sh stage         copy the carried .te<N>/ chunk into /tmp/te-chunks (one per call)
#   bash tools/gpu_install.sh wheels        install .whl/*.whl (megatron-core, TE's Python deps) into python
#   bash tools/gpu_install.sh te            reassemble the TE core wheel, check it, install it and the meta
#                                           wheel, and build transformer_engine_torch against this torch in the
#                                           background (setsid: it outlives the call; log /tmp/te-build.log)
#                                           (or unpack .whl/transformer_engine_torch-*-built-*.tgz, a build
#                                           made with the same torch: by "te-keep" on an earlier machine, or
#                                           here by tools/gpu_wheels.sh --te-build; compiled after all if it
#                                           does not import)
#   bash tools/gpu_install.sh te-wait [S]   wait up to S seconds (default 540) for that build, then import TE
#   bash tools/gpu_install.sh te-keep DIR   pack the built transformer_engine_torch into DIR (e.g. $OUT)
#   bash tools/gpu_install.sh vllm-stage    copy the carried .vllm<N>/ and .vdeps<N>/ folders' files into
#                                           /tmp/vllm-chunks (the dependency wheels into its deps/), one per call
#   bash tools/gpu_install.sh vllm          reassemble the vLLM wheel from its parts in numeric order, check the
#                                           parts, the wheel and the dependency wheels against SHA256SUMS, install
#                                           them all into python (pip, no index, no dependencies), print vLLM's
#                                           version
# vLLM goes into python's own site-packages with pip rather than into a folder on PYTHONPATH: each later call is
# a fresh shell, and every one of them (tools/gpu_check.sh, torchrun's ranks, vLLM's own worker processes) would
# need that variable; pip also puts a wheel's .data files where they belong and writes the `vllm` command.
# DAPO_VLLM_CHUNKS replaces /tmp/vllm-chunks (the tests use it).
set -uo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-python3}"
chunks=/tmp/te-chunks
vchunks=${DAPO_VLLM_CHUNKS:-/tmp/vllm-chunks}
pip_install() { "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$@"; }

case "${1:-}" in
stage)
  mkdir -p $chunks && cp .te[0-9]*/* $chunks/ && ls -la $chunks
  ;;
wheels)
  # megatron-core imports transformer_engine when it is there: import it after the "te" step, not here
  pip_install .whl/*.whl
  ;;
te)
  set -e
  wheel=$(ls $chunks/*.part1 | sed 's/\.part1$//')
  cat $(ls $chunks/*.part* | sort -V) >"$wheel"
  (cd $chunks && sha256sum -c SHA256SUMS)
  pip_install "$wheel"
  built=$(compgen -G ".whl/transformer_engine_torch-*-built-*.tgz" | head -1 || true)
  if [[ -n "$built" ]]; then  # a build made elsewhere (same torch): no need to compile again, if it loads here
    site=$("$py" -c 'import site; print(site.getsitepackages()[0])')
    tar xzf "$built" -C "$site"
    if why=$("$py" -c "import transformer_engine.pytorch" 2>&1); then
      echo 0 >/tmp/te-build.rc && echo "transformer_engine_torch: $built unpacked" | tee /tmp/te-build.log
      exit 0
    fi
    # e.g. built against a newer glibc or libstdc++ than this machine's: take it out and compile here instead
    echo "transformer_engine_torch: $built does not load here, compiling instead: $(echo "$why" | tail -n 1)"
    (cd "$site" && tar tzf "$OLDPWD/$built" | xargs rm -f)
  fi
  sdist=$(ls .whl/transformer_engine_torch-*.tar.gz)
  cp "$sdist" /tmp/
  # sm_90 only (the H100/H200), all cores; the build must outlive this call, so it gets its own session
  setsid nohup env NVTE_CUDA_ARCHS=90 MAX_JOBS="$(nproc)" NVTE_FRAMEWORK=pytorch bash -c \
    "$py -m pip install --no-index --no-deps --no-build-isolation --no-cache-dir /tmp/$(basename "$sdist") \
     >/tmp/te-build.log 2>&1; echo \$? >/tmp/te-build.rc" </dev/null >/dev/null 2>&1 &
  echo "transformer_engine_torch: building in the background (/tmp/te-build.log)"
  ;;
te-wait)
  for _ in $(seq "${2:-540}"); do [[ -f /tmp/te-build.rc ]] && break; sleep 1; done
  tail -n 30 /tmp/te-build.log
  [[ -f /tmp/te-build.rc ]] || { echo "transformer_engine_torch: still building"; exit 1; }
  [[ "$(cat /tmp/te-build.rc)" == 0 ]] || { echo "transformer_engine_torch: build failed"; exit 1; }
  "$py" -c "import transformer_engine.pytorch as te, transformer_engine; print('transformer-engine', transformer_engine.__version__)"
  ;;
te-keep)
  site=$("$py" -c 'import site; print(site.getsitepackages()[0])')
  torch_tag=$("$py" -c 'import torch; print(torch.__version__.replace("+", "-"))')
  te=$("$py" -c 'import importlib.metadata as m; print(m.version("transformer_engine_torch"))')
  # every file pip installed for it (its RECORD): the extension lies in transformer_engine/wheel_lib/
  (cd "$site" && tar czf "$2/transformer_engine_torch-$te-built-torch$torch_tag.tgz" \
    $(cut -d, -f1 transformer_engine_torch-"$te".dist-info/RECORD))
  ls -la "$2"
  ;;
vllm-stage)
  set -e
  shopt -s nullglob
  mkdir -p "$vchunks/deps"
  for f in .vllm[0-9]*/*; do cp "$f" "$vchunks/"; done
  for f in .vdeps[0-9]*/*; do cp "$f" "$vchunks/deps/"; done
  ls -la "$vchunks" "$vchunks/deps" | grep -v ' \.\.\?$'
  ;;
vllm)
  set -e
  shopt -s nullglob
  [[ -f "$vchunks/SHA256SUMS" ]] || { echo "vllm: no $vchunks/SHA256SUMS: stage .vllm1/ first (vllm-stage)"; exit 1; }
  wheel=$(awk '$2 ~ /^vllm-.*[.]whl$/ {print $2}' "$vchunks/SHA256SUMS")
  parts=("$vchunks/$wheel".part*)
  ((${#parts[@]})) || { echo "vllm: no part of $wheel in $vchunks: stage the .vllm<N>/ folders (vllm-stage)"; exit 1; }
  cat $(printf '%s\n' "${parts[@]}" | sort -V) >"$vchunks/$wheel"
  # every part, the wheel they make and each dependency wheel, so that a damaged or missing one is named
  if ! failed=$(cd "$vchunks" && sha256sum --quiet -c SHA256SUMS 2>&1); then
    echo "vllm: sha256 checksums do not match $vchunks/SHA256SUMS (carry the named files again):"
    echo "$failed" | sed 's/^/  /'
    rm -f "$vchunks/$wheel"
    exit 1
  fi
  echo "vllm: $wheel and $(grep -c '  deps/' "$vchunks/SHA256SUMS") dependency wheels match SHA256SUMS"
  pip_install "$vchunks/$wheel" "$vchunks"/deps/*.whl
  "$py" -c "import vllm; print('vllm', vllm.__version__, 'in', vllm.__path__[0])"
  ;;
*)
  sed -n 2,22p "$0"
  exit 2
  ;;
esac
