#!/usr/bin/env bash
# The GPU checks and benchmarks in one call, for the day a GPU machine is lent (15 minutes of device time a
# session, carrying the packages included: docs/gpu.md):
#
#   bash tools/gpu_check.sh [OUT_DIR]                   (default gpu-check/; each step's log and figures there)
#   STEPS="stack fp8" bash tools/gpu_check.sh OUT_DIR   (some steps only; they run in the order below)
#   DRY_RUN=1 bash tools/gpu_check.sh OUT_DIR           (here, on a CPU: every step's commands checked, none run)
#
# First, most valuable first, six checks that fit about 10 minutes of one H200 (their bounds: 600 s in all):
#   stack           DAPO as a user runs it at world 1 under torchrun: vLLM colocated (CUDA graphs, sleep level 1),
#                   TE layers, bf16, a random model of Qwen2.5-0.5B's shape, 5 steps; metrics beside the plan
#   shape-7b        Qwen2.5-7B's shape at world 1 (the 7B recipe cut to one GPU, half the optimizer on the host),
#                   2 short steps; metrics beside the plan
#   moe-vllm        the tiny MoE through vLLM with routing replay, full recompute and a token budget, 3 steps
#   offload-resume  the optimizer on the host, saved and resumed: 3 steps against 2 + resume + 1, weights compared;
#                   the host Adam's time a step
#   sleep2          the demo at vLLM sleep level 2: the engine/actor log-prob gap after each push
#   fp8             FP8 against bf16 at Qwen2.5-7B's hidden size, and the actor's MFU at its layer shape
# then what one GPU settles about context parallelism (90 s):
#   cp-checks       TE's THD partition == the CP split's columns (C 2, 4), TE's attention at C = 1 == the CPU twin's,
#                   the actor's TE THD log-probs and gradients at CP 1 == the local packed path's
#                   (tests/gpu/test_gpu_context_parallel.py; TE's CP collectives at C > 1 need one GPU per rank)
# then the GPU tier and the benchmarks whose figures docs/benchmarks.md records: env gpu-tests bench-logprob
# bench-actor bench-packing bench-memory dapo-step bench-actor-te dapo-stack-demo bench-rollout bench-weight-sync.
#
# Each step is stopped at its time bound with every process under it (torchrun's ranks and vLLM's engine
# included: tests/unit/test_gpu_check_bounds.py); the steps go on after a failure, and the summary at the end
# says which failed. Needs torch with CUDA and megatron-core; steps that need vLLM or Transformer Engine are
# skipped, with the reason, where it does not import.
#
# DRY_RUN=1 runs each step's cheap CPU preparation (random model directories, configs cut to a few layers) and
# its `dapo-mcore plan` (arithmetic), and checks every other command without running it: a DAPO run's config
# and overrides as `dapo-mcore check` does (at --gpus 1 and GPU_GB), a tool's command line with the tool's own
# argument parser, a python snippet by compiling it, every file read. One line a step: "dry-run ok NAME" or
# "dry-run FAILED NAME: why"; the exit status is 1 when one failed.
#
# Environment: STEPS (the steps to run), PYTHON (default: .venv/bin/python where there is one, else python),
# STEP_LIMIT (the later steps' bound, default 600 s), GPU_GB (the GPU's memory for the plans; default: nvidia-smi's,
# else 141, an H200), EXTRA_OVERRIDES (section.key=value ..., added to every DAPO run and its plan), DRY_RUN.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
out="${1:-gpu-check}"
mkdir -p "$out"
py="${PYTHON:-python}"
[[ -n "${PYTHON:-}" || ! -x .venv/bin/python ]] || py=.venv/bin/python  # this checkout's environment, where it has one
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
dry="${DRY_RUN:-}"
[[ "$dry" != 0 ]] || dry=""
first="stack shape-7b moe-vllm offload-resume sleep2 fp8 cp-checks"  # the six, then the CP checks
later="env gpu-tests bench-logprob bench-actor bench-packing bench-memory dapo-step bench-actor-te dapo-stack-demo"
later="$later bench-rollout bench-weight-sync"
steps=" ${STEPS:-$first $later} "
for s in $steps; do  # a misspelt step would otherwise be silently left out
  [[ " $first $later " == *" $s "* ]] || { echo "gpu_check: no step '$s'; the steps: $first $later" >&2; exit 2; }
done
read -ra extra <<<"${EXTRA_OVERRIDES:-}"
# Random models and run directories (a save is GBs) stay out of OUT_DIR, which travels back from the machine.
work="${TMPDIR:-/tmp}/dapo-gpu-check"
runs="$work/runs"
gpu_gb="${GPU_GB:-}"
if [[ -z "$gpu_gb" && -z "$dry" ]] && command -v nvidia-smi >/dev/null; then
  gpu_gb=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | awk 'NR == 1 {printf "%d", $1 / 1024}')
fi
gpu_gb="${gpu_gb:-141}"
todo="$out/.dry-run.todo"  # the dry run's record of every command the steps would run, for the checker at the end
[[ -z "$dry" ]] || : >"$todo"
status=()
declare -A imported=()
has() {  # has MODULE: whether python imports it (asked once: importing vLLM takes seconds)
  if [[ -z "${imported[$1]:-}" ]]; then
    if "$py" -c "import $1" >/dev/null 2>&1; then imported[$1]=yes; else imported[$1]=no; fi
  fi
  [[ "${imported[$1]}" == yes ]]
}
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
current=""  # the step being recorded (dry run)
bounded_step() {  # bounded_step NAME SECONDS COMMAND...: the step's whole output in $out/NAME.txt; COMMAND is a
  # step function below or one command
  local name="$1" limit="$2"
  shift 2
  [[ "$steps" == *" $name "* ]] || return 0
  if [[ -n "$dry" ]]; then  # recorded, not run; the checker at the end gives the verdict
    current=$name
    record begin
    if declare -F "$1" >/dev/null; then "$@"; else gpu "$@"; fi >"$out/$name.txt" 2>&1
    return 0
  fi
  echo "== $name (at most $limit s): $*"
  local start=$SECONDS rc=0
  run_bounded "$limit" "$@" >"$out/$name.txt" 2>&1 || rc=$?
  local metrics  # a run stopped at the bound keeps the steps it logged
  for metrics in "$runs/$name"*/metrics.jsonl; do
    [[ ! -f "$metrics" ]] || cp "$metrics" "$out/$(basename "$(dirname "$metrics")").metrics.jsonl"
  done
  if ((rc == 0)); then status+=("ok      $name ($((SECONDS - start)) s)")
  elif ((rc == 124)); then status+=("TIMEOUT $name (stopped at $limit s, see $out/$name.txt)")
  else status+=("FAILED  $name ($((SECONDS - start)) s, rc $rc, see $out/$name.txt)"); fi
  tail -n 25 "$out/$name.txt"
}
step() { bounded_step "$1" "${STEP_LIMIT:-600}" "${@:2}"; }
skip() { [[ "$steps" == *" $1 "* ]] && status+=("skipped $1: $2"); }
step_needing() {  # step_needing MODULE NAME SECONDS COMMAND...: the step, or "skipped" where MODULE does not
  # import (the dry run checks every step: it imports none of them)
  [[ "$steps" == *" $2 "* ]] || return 0
  if [[ -n "$dry" ]] || has "$1"; then bounded_step "${@:2}"; else skip "$2" "${1%%.*} does not import"; fi
}

# The verbs a step's commands go through, so that the dry run can check what it cannot run:
#   gpu COMMAND...   runs COMMAND; in the dry run it is recorded for the checker instead
#   cpu COMMAND...   runs COMMAND in both modes: cheap preparation on the CPU whose output later commands read
#   plan NAME ...    `dapo-mcore plan` (arithmetic) in both modes
#   need PATH...     files a step reads that none of its commands names (a named one is checked with it)
record() { printf '%s\0' "$current" "$1" "$(($# - 1))" "${@:2}" >>"$todo"; }
gpu() { if [[ -n "$dry" ]]; then record run "$@"; else "$@"; fi; }
cpu() {
  [[ -n "$dry" ]] || { "$@"; return; }
  local rc=0
  "$@" 2>"$todo.stderr" || rc=$?
  cat "$todo.stderr" >&2
  ((rc == 0)) || record fail "${*/#$py/python} exited $rc: $(tail -n 1 "$todo.stderr")"
  return $rc
}
need() {
  local path
  for path; do
    [[ -e "$path" ]] && continue
    echo "missing: $path" >&2
    [[ -z "$dry" ]] || record fail "missing: $path"
    return 1
  done
}
into() {  # into FILE COMMAND...: COMMAND's output in FILE as well as in the step's log; COMMAND's exit status
  "${@:2}" 2>&1 | tee "$1"
  return "${PIPESTATUS[0]}"
}
fresh() {  # fresh RUN...: start these runs from nothing (not a previous check's saves)
  local run
  [[ -n "$dry" ]] || for run; do rm -rf "${runs:?}/$run"; done
}

# Megatron's local attention holds [rows, heads, s, s] scores per layer: sequences stay at 2k tokens or less.
impl=local
has transformer_engine.pytorch && impl=transformer_engine
# Every DAPO run is one process under torchrun (as `slurm/train.sbatch` starts them) with these settings first; a
# step's own overrides come after them and win. No saves unless a step asks: a run saves after its last step
# otherwise (14 B a parameter: 100 GB at 7B).
torchrun=("$py" -m torch.distributed.run --nproc_per_node 1 -m dapo_mcore.cli train)
on_gpu=(parallel.device=cuda model.dtype=bfloat16 model.transformer_impl="$impl" checkpoint.save_interval=0
  logging.plot=false logging.progress=false)
vllm_stack=(rollout.engine=vllm rollout.cuda_graphs=true rollout.sleep_level=1 logging.engine_log=verbose)
dapo() {  # dapo RUN CONFIG OVERRIDES...: a DAPO run in $runs/RUN; its metrics.jsonl kept as $out/RUN.metrics.jsonl
  # and the GPU's memory in use, vLLM's included, sampled every 0.2 s into $out/RUN.gpu-memory.csv (MiB): the
  # metrics' memory/* are readings at the phases' hand-overs, not the peak
  local run=$1 config=$2 rc=0 watch=""
  shift 2
  if [[ -z "$dry" ]] && command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"$out/$run.gpu-memory.csv" 2>&1 &
    watch=$!
  fi
  gpu "${torchrun[@]}" "$config" "${on_gpu[@]}" logging.run_dir="$runs/$run" "$@" "${extra[@]}" || rc=$?
  [[ -z "$watch" ]] || kill "$watch" 2>/dev/null
  [[ -n "$dry" || ! -f "$runs/$run/metrics.jsonl" ]] || cp "$runs/$run/metrics.jsonl" "$out/$run.metrics.jsonl"
  return $rc
}
plan() {  # plan NAME CONFIG OVERRIDES...: `dapo-mcore plan` at a run's settings into $out/NAME.plan.txt, for its
  # peak against the GPU's; in the dry run a plan that does not fit fails the step
  local name=$1 config=$2 rc=0
  shift 2
  "$py" -m dapo_mcore.cli plan "$config" "${on_gpu[@]}" logging.run_dir="$runs/$name" "$@" "${extra[@]}" --gpus 1 \
    --gpu-gb "$gpu_gb" >"$out/$name.plan.txt" 2>&1 || rc=$?
  local verdict  # "fits: peak ..." or "DOES NOT FIT: ...", else the line of the error
  verdict=$(grep -m 1 -E '^(fits|DOES NOT FIT)' "$out/$name.plan.txt" || tail -n 1 "$out/$name.plan.txt")
  echo "dapo-mcore plan: $verdict"
  ((rc == 0)) || [[ -z "$dry" ]] || record fail "plan: $verdict"
  return $rc
}
figures_py='import fnmatch, json, math, sys
from pathlib import Path
out, run, patterns = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
finite = [p.removeprefix("finite:") for p in patterns if p.startswith("finite:")]
patterns = [p.removeprefix("finite:") for p in patterns]
metrics = out / f"{run}.metrics.jsonl"
rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
print(f"{run}: {len(rows)} steps logged")
bad = []
for row in rows:
    step, keys = row.get("step"), sorted(k for k in row if any(fnmatch.fnmatchcase(k, p) for p in patterns))
    shown = [f"{k} {row[k]:.4g}" if isinstance(row[k], float) else f"{k} {row[k]}" for k in keys]
    print(f"step {step}: " + ", ".join(shown))
    bad += [f"step {step} {k}" for k in keys if any(fnmatch.fnmatchcase(k, p) for p in finite)
            and not (isinstance(row[k], (int, float)) and math.isfinite(row[k]))]
used = []
if (out / f"{run}.gpu-memory.csv").exists():
    used = [float(v) for v in (out / f"{run}.gpu-memory.csv").read_text().split() if v.replace(".", "", 1).isdigit()]
if used:
    print(f"GPU memory in use, peak of the run (nvidia-smi every 0.2 s, vLLM included): {max(used) / 1024:.1f} GiB")
if (out / f"{run}.plan.txt").exists():
    verdict = [line for line in (out / f"{run}.plan.txt").read_text().splitlines() if line.startswith(("fits", "DOES"))]
    print("dapo-mcore plan: " + (verdict or ["(no verdict)"])[0])
if bad or not rows:
    sys.exit("not finite: " + ", ".join(bad) if bad else "no metrics")'
figures() {  # figures RUN PATTERN...: one line a step of the metrics matching a PATTERN (fnmatch; finite:PATTERN must
  # be finite numbers), the GPU's peak and the plan's, into $out/RUN.figures.txt
  into "$out/$1.figures.txt" gpu "$py" -c "$figures_py" "$out" "$@"
}
shape_of() {  # shape_of CONFIG.json: tools/make_random_model.py's size flags for an HF config's layer shape
  "$py" -c 'import json, sys
c = json.load(open(sys.argv[1]))
print("--hidden", c["hidden_size"], "--layers", c["num_hidden_layers"], "--ffn", c["intermediate_size"],
      "--heads", c["num_attention_heads"], "--kv-heads", c["num_key_value_heads"])' "$1"
}
random_model() {  # random_model DIR CONFIG.json: a Llama of CONFIG's layer shape with the char tokenizer and no
  # weights (model.init=random). The char tokenizer's 100-token vocabulary, not the real one: a random model samples
  # every id, and each must decode; the real 7B's embedding and head are 1.1B parameters more than this one's.
  local dims
  dims=$(cpu shape_of "$2") || return
  cpu "$py" tools/make_random_model.py --out "$1" $dims
}
cut_config() {  # cut_config CONFIG.json LAYERS OUT.json: the config with its first LAYERS layers only
  mkdir -p "$(dirname "$3")" && "$py" -c 'import json, sys
c = json.load(open(sys.argv[1]))
c["num_hidden_layers"] = int(sys.argv[2])
json.dump(c, open(sys.argv[3], "w"))' "$@"
}

# ---- the six checks: most valuable first, each bounded so that all six fit about 10 minutes ----

stack_step() {
  # The stack a user runs, at world 1: vLLM colocated (CUDA graphs, sleep level 1), bf16, TE layers where TE
  # imports. A random model samples noise, so every group is all-wrong: dynamic sampling would never fill a batch,
  # and it is off here (dapo-stack-demo keeps it on and learns). Figures: the engine/actor gap (mismatch/k3_kl),
  # the step's time and its phases (time/*_s), the memory at each hand-over and the GPU's peak, against the plan.
  local model="$work/models/qwen2.5-0.5b-shape" rc=0
  fresh stack
  random_model "$model" examples/models/Qwen2.5-0.5B/config.json || return
  local settings=("${vllm_stack[@]}" model.hf_path="$model" model.init=random algorithm.dynamic_sampling.enabled=false
    data.max_prompt_len=32 rollout.sampling.max_response_len=512 algorithm.overlong.buffer_len=128
    trainer.mini_batch_size=128 trainer.micro_batch_size=16 trainer.steps=5)
  plan stack examples/smoke_cpu.yaml "${settings[@]}"
  dapo stack examples/smoke_cpu.yaml "${settings[@]}" || rc=$?
  figures stack 'mismatch/*' 'time/*' 'memory/*' || rc=$?
  return $rc
}

shape_7b_step() {
  # Qwen2.5-7B's layer shape (6.5B parameters, random) at world 1: the 7B recipe cut to one GPU (TP 1, no sequence
  # parallelism), its data swapped for the arithmetic prompts (no download), answers of 256 tokens, 64 a step.
  # The optimizer: 6.5B x 16 B (fp32 grads, master, Adam) = 97 GiB, too much beside the engine; all of it on the
  # host is 97 GiB of the machine's 128 with vLLM's pinned copy of the weights beside it, so half goes there
  # (optimizer.offload_fraction=0.5): the plan then has the GPU at 94 GiB of 141 (97 with local layers), the host
  # at 49 GiB. vLLM at 0.3 of the GPU (weights 12 GiB + 29 GiB of KV cache; a step needs 0.02M tokens), eager:
  # capturing CUDA graphs at this size would take much of the bound (the stack step has them).
  local model="$work/models/qwen2.5-7b-shape" rc=0
  fresh shape-7b
  random_model "$model" examples/models/Qwen2.5-7B/config.json || return
  local settings=(rollout.engine=vllm rollout.cuda_graphs=false rollout.sleep_level=1 logging.engine_log=verbose
    model.hf_path="$model" model.init=random parallel.tensor_model_parallel_size=1 parallel.sequence_parallel=false
    optimizer.cpu_offload=true optimizer.offload_fraction=0.5 rollout.gpu_memory_utilization=0.3
    data.source=arithmetic data.eval_files= trainer.eval_interval=0 data.max_prompt_len=32 rollout.max_model_len=0
    rollout.sampling.max_response_len=256 algorithm.overlong.buffer_len=64 algorithm.dynamic_sampling.enabled=false
    rollout.n_samples_per_prompt=8 rollout.prompts_per_step=8 rollout.gen_prompts_per_round=8
    trainer.mini_batch_size=64 trainer.steps=2)
  plan shape-7b examples/dapo_qwen2.5_7b_h100.yaml "${settings[@]}"
  dapo shape-7b examples/dapo_qwen2.5_7b_h100.yaml "${settings[@]}" || rc=$?
  figures shape-7b 'mismatch/*' 'time/*' 'memory/*' 'finite:actor/grad_norm' || rc=$?
  return $rc
}

moe_vllm_step() {
  # The MoE in miniature (Qwen3-MoE, 8 experts, top-2) through vLLM: the engine's routing replayed in the actor,
  # full recompute (the replay must hold when the layers run again) and a token budget of 64 (several
  # micro-batches). Eager: CUDA graphs are the stack step's. Figures: router/agreement and a finite grad norm.
  local rc=0
  fresh moe-vllm
  dapo moe-vllm examples/smoke_cpu.yaml "${vllm_stack[@]}" rollout.cuda_graphs=false \
    model.hf_path=examples/models/tiny-arith-moe model.routing_replay=rollout model.recompute=full \
    trainer.max_tokens_per_micro_batch=64 trainer.steps=3 || rc=$?
  figures moe-vllm 'router/*' 'finite:actor/grad_norm' 'mismatch/k3_kl' || rc=$?
  return $rc
}

# An HF export is read as tests/e2e/test_checkpoints.py reads one (every shard's safetensors in one dict).
compare_py='import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
def weights(export):
    found = {}
    for shard in sorted(Path(export).glob("*.safetensors")):
        found.update(load_file(shard))
    return found
a, b = weights(sys.argv[1]), weights(sys.argv[2])
if not a or set(a) != set(b):
    sys.exit(f"the exports do not hold the same tensors: {len(a)} and {len(b)} ({sys.argv[1]}, {sys.argv[2]})")
diff = {k: (a[k].double() - b[k].double()).abs().max().item() for k in a}
worst = max(diff, key=diff.get)
print(json.dumps({"tensors": len(a), "identical": all(torch.equal(a[k], b[k]) for k in a),
                  "max_abs_diff": diff[worst], "worst_tensor": worst}))'
offload_resume_step() {
  # The optimizer on the host (optimizer.cpu_offload) saved in the format that reshards across DP, and resumed:
  # run A trains 3 steps uninterrupted; run B trains 2 and saves, then a second start resumes it
  # (checkpoint.resume=auto) to step 3. Their HF exports after step 3 are compared: the CPU suite holds them
  # bitwise equal; on a GPU, kernels that add in another order may leave last-bit differences (the figure: max
  # abs diff). The HF engine: three vLLM starts would not fit the bound, and the engine is not what is checked.
  # Then the host Adam's time a step, fused and not.
  local rc=0 settings=(rollout.engine=hf optimizer.cpu_offload=true parallel.use_distributed_optimizer=true
    checkpoint.optimizer_format=dp_reshardable checkpoint.hf_export_interval=1)
  fresh offload-resume.A offload-resume.B
  dapo offload-resume.A examples/smoke_cpu.yaml "${settings[@]}" trainer.steps=3 checkpoint.save_interval=3 || rc=$?
  dapo offload-resume.B examples/smoke_cpu.yaml "${settings[@]}" trainer.steps=2 checkpoint.save_interval=2 || rc=$?
  dapo offload-resume.B examples/smoke_cpu.yaml "${settings[@]}" trainer.steps=3 checkpoint.save_interval=2 \
    checkpoint.resume=auto || rc=$?
  into "$out/offload-resume.weights.json" gpu "$py" -c "$compare_py" \
    "$runs/offload-resume.A/checkpoints/hf/step_000003" "$runs/offload-resume.B/checkpoints/hf/step_000003" || rc=$?
  gpu "$py" tools/bench_cpu_adam.py --params-m 500 --threads 16 --out "$out/cpu-adam.json" || rc=$?
  return $rc
}

sleep2_step() {
  # Sleep level 2: vLLM frees its weights and KV cache while the actor trains and keeps no pinned host copy; the
  # push must then restore every weight and vLLM its buffers (CUDA graphs on). The figure: the engine/actor
  # log-prob gap after each push (the mismatch guard's mismatch/* metrics), a step a line.
  local rc=0
  fresh sleep2
  dapo sleep2 examples/smoke_cpu.yaml "${vllm_stack[@]}" rollout.sleep_level=2 trainer.steps=4 || rc=$?
  figures sleep2 'mismatch/*' 'time/step_s' 'memory/*' || rc=$?
  return $rc
}

fp8_step() {
  # FP8 pays where the matmuls are large: at Qwen2.5-7B's hidden size (3584), its config cut to 4 layers (one GPU
  # holds them with the optimizer), seq 4096, TE; bf16 against FP8 (blockwise) in one run. Then the actor's MFU at
  # that layer shape, bf16, against Megatron-Core's own loop (model TFLOP/s over the GPU's dense bf16 peak;
  # Megatron's published figure is 47%).
  local config="$work/models/qwen2.5-7b-4-layers/config.json" rc=0
  cpu cut_config examples/models/Qwen2.5-7B/config.json 4 "$config" || return
  into "$out/fp8.vs-bf16.txt" gpu "$py" tools/bench_actor.py --hf "$config" --seq 4096 --micro-batch 1 \
    --micro-batches 4 --steps 3 --warmup 1 --dtype bfloat16 --transformer-impl transformer_engine --fp8 e4m3 \
    --fp8-recipe blockwise || rc=$?
  into "$out/fp8.mfu.txt" gpu "$py" tools/bench_actor.py --hf "$config" --seq 4096 --micro-batch 1 \
    --micro-batches 8 --steps 3 --warmup 1 --dtype bfloat16 --transformer-impl transformer_engine || rc=$?
  return $rc
}

step_needing vllm stack 150 stack_step
step_needing vllm shape-7b 120 shape_7b_step
step_needing vllm moe-vllm 60 moe_vllm_step
bounded_step offload-resume 105 offload_resume_step
step_needing vllm sleep2 75 sleep2_step
step_needing transformer_engine.pytorch fp8 90 fp8_step

# ---- what one GPU settles about context parallelism (docs/design/context_parallel.md section 9 step 10) ----

cp_checks_step() {
  # pytest's own report (its skips with their reasons: -rs) also in $out/cp-checks.figures.txt
  local tests=tests/gpu/test_gpu_context_parallel.py
  need "$tests" tests/gpu/workers/cp_attention.py tests/dist/workers/actor_grads.py || return
  into "$out/cp-checks.figures.txt" gpu "$py" -m pytest -q -rs "$tests"
}
step_needing transformer_engine.pytorch cp-checks 90 cp_checks_step

# ---- the GPU tier and the benchmarks (each STEP_LIMIT, default 600 s, unless given) ----

env_step() {
  gpu nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  gpu "$py" -c '
import torch, megatron.core as m
print("torch", torch.__version__, "cuda", torch.version.cuda, "megatron-core", m.__version__)
for name in ("transformer_engine", "vllm"):
    try:
        print(name, __import__(name).__version__)
    except Exception as e:
        print(name + ": not importable:", e)'
}
gpu_tests_step() {
  need tests/gpu tests/engines/test_engine_contract.py || return
  gpu "$py" -m pytest -q -rs tests/gpu tests/engines/test_engine_contract.py -k "gpu or cuda"
}
bench_logprob_step() {
  gpu "$py" tools/bench_logprob.py --tokens 4096 16384 --hidden 3584 --vocab 151936 --dtype bfloat16 --device cuda &&
    gpu "$py" tools/bench_logprob.py --tokens 16384 --hidden 3584 --vocab 151936 --dtype bfloat16 --device cuda \
      --chunk 4096
}
dapo_step_step() {  # one DAPO step of a random 0.5B Llama with the HF engine on CUDA
  local model="$work/models/llama-0.5b"
  cpu "$py" tools/make_random_model.py --out "$model" || return
  gpu "$py" tools/bench_step.py examples/smoke_cpu.yaml model.hf_path="$model" model.init=random \
    model.dtype=bfloat16 parallel.device=cuda model.transformer_impl=local rollout.engine=hf data.max_prompt_len=32 \
    rollout.sampling.max_response_len=512 algorithm.dynamic_sampling.enabled=false algorithm.overlong.buffer_len=128 \
    rollout.n_samples_per_prompt=8 rollout.prompts_per_step=16 rollout.gen_prompts_per_round=16 \
    trainer.mini_batch_size=128 trainer.micro_batch_size=16 "${extra[@]}" --steps 3 --warmup 1
}
stack_demo_step() {  # the demo recipe on the whole stack for 30 steps: it learns
  fresh dapo-stack-demo
  dapo dapo-stack-demo examples/smoke_cpu.yaml "${vllm_stack[@]}" trainer.steps=30
}
qwen=examples/models/Qwen2.5-0.5B/config.json
step env env_step
step gpu-tests gpu_tests_step
step bench-logprob bench_logprob_step
step bench-actor "$py" tools/bench_actor.py --hf $qwen --seq 1024 --micro-batch 4 --micro-batches 8 --steps 5 \
  --warmup 2 --transformer-impl local
step bench-packing "$py" tools/bench_actor.py --hf $qwen --long-cot 64 --min-len 128 --max-len 2048 \
  --micro-batch 2 --steps 3 --warmup 1 --transformer-impl local
# Without Transformer Engine the layers are Megatron's local ones, whose attention holds [heads, s, s] scores per
# layer (the plan counts them): a 16k-token row of the 500M model then needs far more than a GPU (seen on an H200)
memory_cases="80M:4096 500M:4096 500M:4096:full"
has transformer_engine.pytorch && memory_cases="80M:4096 500M:4096 500M:16384 500M:16384:full"
step bench-memory "$py" tools/bench_memory.py --device cuda --cases $memory_cases
step dapo-step dapo_step_step
step_needing transformer_engine.pytorch bench-actor-te "${STEP_LIMIT:-600}" "$py" tools/bench_actor.py --hf $qwen \
  --seq 1024 --micro-batch 8 --micro-batches 4 --steps 5 --warmup 2 --transformer-impl transformer_engine
step_needing vllm dapo-stack-demo 300 stack_demo_step
step_needing vllm bench-rollout "${STEP_LIMIT:-600}" "$py" tools/bench_rollout.py --prompts 64 --n 16 --max-new 1024
step_needing vllm bench-weight-sync "${STEP_LIMIT:-600}" "$py" tools/bench_weight_sync.py --engine vllm \
  --bucket-mb 64 256 512 1024

if [[ -z "$dry" ]]; then
  printf '%s\n' "${status[@]}"
  # a step that failed or ran out of time fails the call, so its reader looks (its own file says why)
  [[ "${status[*]}" != *FAILED* && "${status[*]}" != *TIMEOUT* ]]
  exit
fi

# ---- the dry run's checker: one process for every recorded command (Megatron and the schema imported once) ----
"$py" tools/gpu_check_dry_run.py "$todo" "$py" "$gpu_gb"
