#!/usr/bin/env python
"""The memory planner (dapo_mcore/plan.py) against measured peaks of real actor updates on the CPU.

    python tools/bench_memory.py                       # the six default cases, about 3 minutes on 2 cores
    python tools/bench_memory.py --cases 20M:1024 80M:4096:full

Each case runs in a fresh process: init the CPU (gloo) world, note the resident set size, build the actor as
build.py does (provider -> GPTModel, Megatron DDP, distributed optimizer; float32, the local layer spec), then
one `train_step` over two mini-batches of synthetic samples of one fixed length, so the second mini-batch's
forward and backward run beside the Adam state the first one created. Measured: peak RSS (ru_maxrss) minus
the RSS just before the model was built. Planned: the actor's lines of the plan's train phase (weights,
gradients, optimizer, activations, score buffer, peak transient, step batch) for the same config.

--device cuda: the same cases in bfloat16 on a GPU, measured as torch.cuda.max_memory_allocated() minus the
allocation before the model was built (the planner's figures are per GPU, so this is their home ground):

    python tools/bench_memory.py --device cuda --cases 80M:4096 500M:4096 500M:16384 500M:16384:full

glibc's malloc raises its mmap threshold each time a large block is freed (up to 32 MiB), after which freed
tensors of that size stay in its heap: RSS then counts memory the process no longer uses, more of it the more
steps ran. The children therefore run with MALLOC_MMAP_THRESHOLD_=65536 (every block of 64 KiB or more is
mapped and unmapped), so RSS follows the live tensors; --glibc-default measures without it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = {  # random Llama configs: ~20M and ~83M parameters, most of the smaller one in its embeddings
    "20M": dict(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, intermediate_size=768
    ),
    "80M": dict(
        hidden_size=512, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=4, intermediate_size=1536
    ),
    "500M": dict(  # ~0.5B, for the GPU
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4, intermediate_size=4096
    ),
}
PROMPT, RESPONSE = 64, 448  # every sample: 512 tokens
DEFAULT_CASES = ("20M:1024", "20M:4096", "80M:1024", "80M:4096", "80M:4096:full", "20M:2048:selective")


def hf_config(name: str) -> dict:
    return dict(
        model_type="llama",
        vocab_size=32000,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=False,
        **MODELS[name],
    )


def run_config(budget: int, recompute: str, device: str = "cpu"):
    from dapo_mcore.config import load_config
    from dapo_mcore.mcore.provider import transformer_engine_available

    rows = budget // (PROMPT + RESPONSE)
    # named, so that the plan counts the layers the build makes: "auto" plans TE's on a GPU, but builds Megatron's
    # local ones where TE does not import (an H200 run without TE measured 5x the plan of TE layers)
    impl = "transformer_engine" if device == "cuda" and transformer_engine_available() else "local"
    return load_config(
        None,
        [
            f"parallel.device={device}",
            f"model.transformer_impl={impl}",
            f"model.dtype={'float32' if device == 'cpu' else 'bfloat16'}",
            "model.init=random",
            f"model.recompute={recompute}",
            f"trainer.max_tokens_per_micro_batch={budget}",
            f"trainer.mini_batch_size={rows}",
            f"trainer.micro_batch_size={rows}",
            # the step the plan's "step batch" line counts: the two mini-batches build_and_step trains
            f"rollout.prompts_per_step={2 * rows}",
            f"rollout.gen_prompts_per_round={2 * rows}",
            "rollout.n_samples_per_prompt=1",
            f"rollout.sampling.max_response_len={RESPONSE}",
            f"data.max_prompt_len={PROMPT}",
            "algorithm.overlong.buffer_len=64",
            "optimizer.warmup_steps=0",
        ],
    )


def synthetic_samples(n: int, vocab: int) -> list:
    import torch

    from dapo_mcore.data.types import Sample

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        ids = torch.randint(4, vocab, (PROMPT + RESPONSE,), generator=g).tolist()
        out.append(
            Sample(
                prompt_ids=ids[:PROMPT],
                response_ids=ids[PROMPT:],
                rollout_logprobs=[-1.0] * RESPONSE,
                finish_reason="length",
                advantage=1.0 if i % 2 else -1.0,
                old_logprobs=[-1.0] * RESPONSE,
            )
        )
    return out


def measure(model: str, budget: int, recompute: str, device: str) -> dict:
    """In this (fresh) process: the memory growth of building the actor and one train_step of two
    mini-batches (RSS on the CPU, torch's allocations on a GPU)."""
    if device == "cuda":
        return measure_cuda(model, budget, recompute)
    import gc

    import psutil
    import torch

    from dapo_mcore.parallel import destroy_parallel, init_parallel

    torch.set_num_threads(2)
    ctx = init_parallel(1, 1, "cpu")
    gc.collect()
    before = psutil.Process().memory_info().rss
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    build_and_step(ctx, model, budget, recompute, "cpu")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    destroy_parallel()
    if peak <= peak_before:
        raise RuntimeError("the peak RSS was reached before the model was built: nothing measured")
    return {"measured": peak - before}


def build_and_step(ctx, model: str, budget: int, recompute: str, device: str) -> None:
    """Build the actor as build.py does and run one train_step of two mini-batches."""
    from dapo_mcore.build import actor_settings, load_policy_chunks, optimizer_settings
    from dapo_mcore.config.model_spec import read_model_spec
    from dapo_mcore.mcore.actor import build_actor

    cfg, spec = run_config(budget, recompute, device), read_model_spec(hf_config(model))
    chunks, family = load_policy_chunks(cfg, ctx, spec)
    settings = actor_settings(cfg, pad_id=0, use_te=family.te_layer_names)
    actor = build_actor(ctx, spec, chunks, optimizer_settings(cfg), settings)
    rows = cfg.trainer.mini_batch_size
    samples = synthetic_samples(2 * rows, spec.vocab_size)
    actor.train_step(actor.prepare(samples, [list(range(rows)), list(range(rows, 2 * rows))]))


def measure_cuda(model: str, budget: int, recompute: str) -> dict:
    import torch

    from dapo_mcore.parallel import destroy_parallel, init_parallel

    ctx = init_parallel(1, 1, "cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    build_and_step(ctx, model, budget, recompute, "cuda")
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    destroy_parallel()
    return {"measured": peak - before}


def planned(model: str, budget: int, recompute: str, device: str = "cpu") -> dict:
    from dapo_mcore.plan import plan_memory

    cfg = run_config(budget, recompute, device)
    plan = plan_memory(cfg, hf_config(model), gpu_gb=1024, gpus=1)
    lines = [line for line in plan.phase("train").lines if line.kind == "actor"]
    return {"planned": sum(line.bytes for line in lines), "lines": {line.name: line.bytes for line in lines}}


def run_case(case: str, glibc_default: bool, device: str) -> dict:
    model, budget, *rest = case.split(":")
    recompute = rest[0] if rest else "none"
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONWARNINGS": "ignore", "PYTHONPATH": pythonpath}
    if not glibc_default:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    cmd = [sys.executable, __file__, "--measure", case, "--device", device]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"case {case} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "case": case,
        "model": model,
        "budget": int(budget),
        "recompute": recompute,
        **measured,
        "device": device,
        **planned(model, int(budget), recompute, device),
    }


def report(results: list[dict]) -> None:
    mib = 1 << 20
    print("| model | params | token budget | recompute | planned MiB | measured MiB | planned / measured |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        params = r["lines"]["actor weights"] / (4 if r["device"] == "cpu" else 2) / 1e6
        print(
            f"| {r['model']} | {params:.1f}M | {r['budget']} | {r['recompute']} | {r['planned'] / mib:.0f} | "
            f"{r['measured'] / mib:.0f} | {r['planned'] / r['measured']:.2f} |"
        )
    print("\nplanned lines (MiB):")
    for r in results:
        print(f"  {r['case']}: " + ", ".join(f"{k} {v / mib:.0f}" for k, v in r["lines"].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), help="MODEL:BUDGET[:RECOMPUTE]")
    ap.add_argument("--glibc-default", action="store_true", help="measure without MALLOC_MMAP_THRESHOLD_")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: bfloat16, torch's allocations")
    ap.add_argument("--measure", help=argparse.SUPPRESS)  # the child process of one case
    args = ap.parse_args()
    if args.measure:
        model, budget, *rest = args.measure.split(":")
        print(json.dumps(measure(model, int(budget), rest[0] if rest else "none", args.device)))
        return
    report([run_case(case, args.glibc_default, args.device) for case in args.cases])


if __name__ == "__main__":
    main()
