#!/usr/bin/env bash
# The GPU tier and the GPU benchmarks in one call, for the day a GPU machine is lent:
#
#   bash tools/gpu_check.sh [OUT_DIR]      (default: gpu-check/; each step's output in its own file)
#   STEPS="gpu-tests bench-fp8" bash tools/gpu_check.sh OUT_DIR     (some steps only)
#
# Runs every CUDA test (tests/gpu and the cuda engine-contract cases, each skipped with its reason where a
# package is missing) and the benchmarks whose GPU figures docs/benchmarks.md records: the fused log-prob
# head at the real shape, the actor against Megatron-Core's own loop (Qwen2.5-0.5B's shape, bf16), packed
# vs padded rows, the planner against torch.cuda.max_memory_allocated, one DAPO step of a random 0.5B Llama
# with the HF engine on CUDA; with Transformer Engine also the TE actor and FP8 vs bf16; with vLLM the
# rollout and weight-push benchmarks. Steps go on after a failure; the summary at the end says which failed.
# Needs torch with CUDA and megatron-core (docs/gpu.md: carrying them to a machine without network).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-check}"
mkdir -p "$out"
py="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
all="env gpu-tests bench-logprob bench-actor bench-packing bench-memory dapo-step bench-actor-te bench-fp8"
all="$all bench-rollout bench-weight-sync"
steps=" ${STEPS:-$all} "
status=()
has() { "$py" -c "import $1" >/dev/null 2>&1; }
step() {
  local name="$1"
  shift
  [[ "$steps" == *" $name "* ]] || return 0
  echo "== $name: $*"
  local start=$SECONDS
  if "$@" >"$out/$name.txt" 2>&1; then status+=("ok      $name ($((SECONDS - start)) s)"); else
    status+=("FAILED  $name ($((SECONDS - start)) s, see $out/$name.txt)")
  fi
  tail -n 25 "$out/$name.txt"
}
skip() { [[ "$steps" == *" $1 "* ]] && status+=("skipped $1: $2"); }
# Megatron's local attention holds [rows, heads, s, s] scores per layer: sequences stay at 2k tokens or less.
qwen=examples/models/Qwen2.5-0.5B/config.json
random_llama="${TMPDIR:-/tmp}/dapo-gpu-check-llama-0.5b"

step env bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $py -c '
import torch, megatron.core as m; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"megatron-core\", m.__version__)
try:
    import transformer_engine as te; print(\"transformer-engine\", te.__version__)
except Exception as e: print(\"transformer-engine: not importable:\", e)'"
step gpu-tests "$py" -m pytest -q -rs tests/gpu tests/engines/test_engine_contract.py -k "gpu or cuda"
step bench-logprob bash -c "$py tools/bench_logprob.py --tokens 4096 16384 --hidden 3584 --vocab 151936 \
  --dtype bfloat16 --device cuda && $py tools/bench_logprob.py --tokens 16384 --hidden 3584 --vocab 151936 \
  --dtype bfloat16 --device cuda --chunk 4096"
step bench-actor "$py" tools/bench_actor.py --hf $qwen --seq 1024 --micro-batch 4 --micro-batches 8 --steps 5 \
  --warmup 2 --transformer-impl local
step bench-packing "$py" tools/bench_actor.py --hf $qwen --long-cot 64 --min-len 128 --max-len 2048 \
  --micro-batch 2 --steps 3 --warmup 1 --transformer-impl local
# Without Transformer Engine the layers are Megatron's local ones, whose attention holds [heads, s, s] scores per
# layer (the plan counts them): a 16k-token row of the 500M model then needs far more than a GPU (seen on an H200)
memory_cases="80M:4096 500M:4096 500M:4096:full"
has transformer_engine.pytorch && memory_cases="80M:4096 500M:4096 500M:16384 500M:16384:full"
step bench-memory "$py" tools/bench_memory.py --device cuda --cases $memory_cases
step dapo-step bash -c "$py tools/make_random_model.py --out $random_llama && $py tools/bench_step.py \
  examples/smoke_cpu.yaml model.hf_path=$random_llama model.init=random model.dtype=bfloat16 parallel.device=cuda \
  model.transformer_impl=local rollout.engine=hf rollout.sampling.max_response_len=512 \
  algorithm.dynamic_sampling.enabled=false \
  algorithm.overlong.buffer_len=128 rollout.n_samples_per_prompt=8 rollout.prompts_per_step=16 \
  rollout.gen_prompts_per_round=16 trainer.mini_batch_size=128 trainer.micro_batch_size=16 --steps 3 --warmup 1"
if has transformer_engine.pytorch; then
  step bench-actor-te "$py" tools/bench_actor.py --hf $qwen --seq 1024 --micro-batch 8 --micro-batches 4 \
    --steps 5 --warmup 2 --transformer-impl transformer_engine
  step bench-fp8 "$py" tools/bench_actor.py --hf $qwen --seq 1024 --micro-batch 8 --micro-batches 4 --steps 5 \
    --warmup 2 --transformer-impl transformer_engine --fp8 e4m3 --fp8-recipe blockwise
else
  for s in bench-actor-te bench-fp8; do skip $s "transformer_engine does not import"; done
fi
if has vllm; then
  step bench-rollout "$py" tools/bench_rollout.py --prompts 64 --n 16 --max-new 1024
  step bench-weight-sync "$py" tools/bench_weight_sync.py --engine vllm --bucket-mb 64 256 512 1024
else
  for s in bench-rollout bench-weight-sync; do skip $s "vllm does not import"; done
fi
printf '%s\n' "${status[@]}"
