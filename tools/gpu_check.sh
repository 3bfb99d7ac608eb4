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
# rollout and weight-push benchmarks, and the whole stack a user runs: DAPO with vLLM colocated (CUDA graphs,
# sleep level 1) on TE layers in bf16 (a random Qwen2.5-0.5B-shaped model; the demo model, which learns), an
# MoE with routing replay through vLLM, and the actor's MFU at Qwen2.5-7B's layer shape. Steps go on after a
# failure, each stopped at its time bound (STEP_LIMIT, default 600 s; some have their own); the summary at the
# end says which failed. Needs torch with CUDA and megatron-core (docs/gpu.md: carrying them to a machine
# without network).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-gpu-check}"
mkdir -p "$out"
py="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
all="env gpu-tests bench-logprob bench-actor bench-packing bench-memory dapo-step bench-actor-te bench-fp8"
all="$all bench-mfu dapo-stack dapo-stack-demo sleep2-demo moe-vllm bench-rollout bench-weight-sync"
steps=" ${STEPS:-$all} "
status=()
has() { "$py" -c "import $1" >/dev/null 2>&1; }
step() { bounded_step "$1" "${STEP_LIMIT:-600}" "${@:2}"; }
descendants() { local p; for p in $(pgrep -P "$1"); do echo "$p"; descendants "$p"; done; }
run_bounded() {  # run_bounded SECONDS COMMAND...: at SECONDS the command and every process under it are killed
  # (torchrun's ranks start sessions of their own and vLLM's engine runs in a child: a process-group kill would
  # leave them holding the GPU that the next step needs)
  local limit=$1 waited=0
  shift
  "$@" &
  local pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    if ((waited >= limit)); then
      kill -9 "$pid" $(descendants "$pid") 2>/dev/null
      wait "$pid"
      return 124
    fi
    sleep 1
    waited=$((waited + 1))
  done
  wait "$pid"
}
bounded_step() {  # bounded_step NAME SECONDS COMMAND...: the step's whole output in $out/NAME.txt
  local name="$1" limit="$2"
  shift 2
  [[ "$steps" == *" $name "* ]] || return 0
  echo "== $name (at most $limit s): $*"
  local start=$SECONDS rc=0
  run_bounded "$limit" "$@" >"$out/$name.txt" 2>&1 || rc=$?
  if ((rc == 0)); then status+=("ok      $name ($((SECONDS - start)) s)")
  elif ((rc == 124)); then status+=("TIMEOUT $name (stopped at $limit s, see $out/$name.txt)")
  else status+=("FAILED  $name ($((SECONDS - start)) s, rc $rc, see $out/$name.txt)"); fi
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
  # the actor's MFU at Qwen2.5-7B's layer shape (its config cut to 4 layers, which one GPU holds with the
  # optimizer), seq 4096, bf16, TE; model TFLOP/s over the GPU's dense bf16 peak, beside Megatron's 47%
  mfu_config="${TMPDIR:-/tmp}/dapo-gpu-check-qwen2.5-7b-4-layers/config.json"
  mkdir -p "$(dirname "$mfu_config")" && "$py" -c "import json, sys
c = json.load(open('examples/models/Qwen2.5-7B/config.json'))
c['num_hidden_layers'] = 4; json.dump(c, open(sys.argv[1], 'w'))" "$mfu_config"
  step bench-mfu "$py" tools/bench_actor.py --hf "$mfu_config" --seq 4096 --micro-batch 1 --micro-batches 8 \
    --steps 5 --warmup 2 --transformer-impl transformer_engine
else
  for s in bench-actor-te bench-fp8 bench-mfu; do skip $s "transformer_engine does not import"; done
fi
# The stack a user runs, as one DAPO run under torchrun: vLLM colocated (CUDA graphs, sleep level 1), bf16, TE
# layers where TE imports. A random model samples noise, so every group is all-wrong: dynamic sampling would
# never fill a batch, and it is off here (the demo-model run below keeps it on and learns).
impl=local
has transformer_engine.pytorch && impl=transformer_engine
cuda_run=("$py" -m torch.distributed.run --nproc_per_node 1 -m dapo_mcore.cli train examples/smoke_cpu.yaml
  parallel.device=cuda model.dtype=bfloat16 model.transformer_impl=$impl rollout.engine=vllm rollout.cuda_graphs=true
  rollout.sleep_level=1 logging.engine_log=verbose logging.plot=false logging.progress=false)
qwen_shaped="${TMPDIR:-/tmp}/dapo-gpu-check-qwen2.5-0.5b-shape"
run_root="${TMPDIR:-/tmp}/dapo-gpu-check-runs"
dapo_run() {  # dapo_run NAME SECONDS OVERRIDES...: the run's metrics.jsonl kept as $out/NAME.metrics.jsonl
  bounded_step "$1" "$2" "${cuda_run[@]}" logging.run_dir="$run_root/$1" "${@:3}"
  [[ ! -f "$run_root/$1/metrics.jsonl" ]] || cp "$run_root/$1/metrics.jsonl" "$out/$1.metrics.jsonl"
}
if has vllm; then
  [[ "$steps" != *" dapo-stack "* ]] || "$py" tools/make_random_model.py --out "$qwen_shaped" --hidden 896 \
    --layers 24 --ffn 4864 --heads 14 --kv-heads 2
  dapo_run dapo-stack 420 model.hf_path="$qwen_shaped" model.init=random algorithm.dynamic_sampling.enabled=false \
    rollout.sampling.max_response_len=512 algorithm.overlong.buffer_len=128 trainer.mini_batch_size=128 \
    trainer.micro_batch_size=16 trainer.steps=10
  dapo_run dapo-stack-demo 300 trainer.steps=30
  # sleep level 2 (weights and KV cache freed while the actor trains, no pinned host copy of the weights): the
  # push must restore every weight and vLLM its buffers; the mismatch guard's engine/actor log-prob gap says so
  dapo_run sleep2-demo 200 trainer.steps=10 rollout.sleep_level=2
  dapo_run moe-vllm 240 model.hf_path=examples/models/tiny-arith-moe model.routing_replay=rollout trainer.steps=3
  step bench-rollout "$py" tools/bench_rollout.py --prompts 64 --n 16 --max-new 1024
  step bench-weight-sync "$py" tools/bench_weight_sync.py --engine vllm --bucket-mb 64 256 512 1024
else
  for s in dapo-stack dapo-stack-demo sleep2-demo moe-vllm bench-rollout bench-weight-sync; do
    skip $s "vllm does not import"
  done
fi
printf '%s\n' "${status[@]}"
