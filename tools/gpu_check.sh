#!/usr/bin/env bash
# The GPU tier and the GPU benchmarks in one call, for the day a GPU machine is lent:
#
#   bash tools/gpu_check.sh [OUT_DIR]      (default: gpu-check/; each step's output in its own file)
#
# Runs every CUDA test (tests/gpu and the cuda engine-contract cases, each skipped with its reason where a
# package is missing) and the benchmarks whose GPU figures docs/benchmarks.md still lacks. Steps go on after
# a failure; the summary at the end says which failed. Needs torch with CUDA and megatron-core installed
# (plus transformer-engine / vllm / sglang for their parts).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-check}"
mkdir -p "$out"
py="${PYTHON:-python}"
status=()
step() {
  local name="$1"
  shift
  echo "== $name: $*"
  if "$@" >"$out/$name.txt" 2>&1; then status+=("ok      $name"); else status+=("FAILED  $name (see $out/$name.txt)"); fi
  tail -n 15 "$out/$name.txt"
}
step gpu-tests "$py" -m pytest -q -rs tests/gpu tests/engines/test_engine_contract.py -k "gpu or cuda"
step bench-logprob "$py" tools/bench_logprob.py --tokens 4096 16384 --hidden 3584 --vocab 151936 --dtype bfloat16 --device cuda
step bench-rollout "$py" tools/bench_rollout.py --prompts 64 --n 16 --max-new 1024
step bench-weight-sync "$py" tools/bench_weight_sync.py --engine vllm --bucket-mb 64 256 512 1024
printf '%s\n' "${status[@]}"
