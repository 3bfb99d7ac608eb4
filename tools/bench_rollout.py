#!/usr/bin/env python
"""Generated tokens/s of the rollout engines on the same model, prompts and lengths.

    python tools/bench_rollout.py [--model DIR] [--prompts 16] [--n 8] [--max-new 128] [--repeats 3]

Cases, each in a fresh process so one engine's threads or memory never colour another's:
  hf          Hugging Face `generate` (the reference engine), weights loaded from disk;
  vllm        vLLM standalone, weights loaded from disk;
  vllm-train  vLLM inside the trainer: the run is built by `build_run` (Megatron actor in the same
              process), the engine starts without weights, receives the actor's through the weight push,
              goes through a release/resume (sleep/wake) cycle, and generates.
Without --model a random Llama is made (hidden 512, 8 layers, 8 heads of 64, vocab 100: ~25M parameters
without embeddings) with the char tokenizer; tokens/s counts the tokens actually generated (EOS may end
an answer early: every case draws with the same seeds from the same weights, so the counts stay close).
Prints a markdown table with each case's ratio to the HF engine measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CASES = ("hf", "vllm", "vllm-train")


def make_model(out: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from dapo_mcore.data.tokenizer import build_char_tokenizer, vocab_size

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size(),
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    build_char_tokenizer(out)
    return out


def prompts(tokenizer, count: int) -> list[list[int]]:
    return [tokenizer(f"What is {i}+{2 * i + 1}?\n").input_ids for i in range(count)]


def standalone_engine(name: str, args):
    from dapo_mcore.rollout.base import EngineSettings
    from dapo_mcore.rollout.registry import create_engine

    settings = EngineSettings(model_path=args.model, device=args.device, dtype=args.dtype, cpu_kv_cache_mb=1024)
    return create_engine(name, settings), None


def engine_in_trainer(args, run_dir: str):
    from dapo_mcore.build import build_run
    from dapo_mcore.config import load_config
    from dapo_mcore.trainer import push_weights

    overrides = [
        f"model.hf_path={args.model}",
        f"model.dtype={args.dtype}",
        f"parallel.device={args.device}",
        "rollout.engine=vllm",
        "rollout.cpu_kv_cache_mb=1024",
        f"logging.run_dir={run_dir}",
        "logging.wandb.mode=disabled",
        "logging.progress=false",
    ]
    run = build_run(load_config(str(REPO / "examples/smoke_cpu.yaml"), overrides))
    for _ in range(2):  # as after two training steps: push, sleep, wake
        push_weights(run)
        run.engine.release_memory()
        run.engine.resume_memory()
    return run.engine, run


def run_case(args) -> dict:
    from transformers import AutoTokenizer

    from dapo_mcore.rollout.base import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        if args.case == "vllm-train":
            engine, run = engine_in_trainer(args, f"{tmp}/run")
        else:
            engine, run = standalone_engine(args.case, args)
        ids = prompts(AutoTokenizer.from_pretrained(args.model), args.prompts)
        params = lambda seed: SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new, seed=seed)
        engine.generate(ids[:2], params(0))  # warm-up: first-call set-up is not generation speed
        tokens, seconds = 0, 0.0
        for repeat in range(args.repeats):
            start = time.perf_counter()
            out = engine.generate(ids, params(1000 + repeat))
            seconds += time.perf_counter() - start
            tokens += sum(len(c.token_ids) for group in out for c in group)
        if run is not None:
            from dapo_mcore.trainer import finish

            finish(run)
        else:
            engine.shutdown()
    return {"case": args.case, "tokens": tokens, "seconds": seconds}


def measure(args, case: str) -> dict:
    case_args = ["--case", case, "--model", args.model, "--prompts", str(args.prompts), "--n", str(args.n)]
    case_args += ["--max-new", str(args.max_new), "--repeats", str(args.repeats)]
    case_args += ["--device", args.device, "--dtype", args.dtype]
    return case_in_fresh_process(__file__, case_args, f"case {case}")


def case_in_fresh_process(script: str, case_args: list[str], what: str) -> dict:
    """One case of a benchmark script in a fresh Python process (so no case inherits another's threads or
    memory); the case prints its result as JSON on its last line."""
    proc = subprocess.run([sys.executable, script, *case_args], capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
    ap.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one case, in this process
    args = ap.parse_args()
    if args.case:
        print(json.dumps(run_case(args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if not args.model:
            args.model = str(make_model(Path(tmp) / "model"))
        results = [measure(args, case) for case in args.cases.split(",")]
    print(
        f"{platform.processor() or platform.machine()} ({args.device}, {args.dtype}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; "
        f"{args.prompts} prompts x {args.n} answers, up to {args.max_new} new tokens, {args.repeats} repeats"
    )
    base = next((r for r in results if r["case"] == "hf"), results[0])
    base_rate = base["tokens"] / base["seconds"]
    print("| engine | tokens | seconds | tokens/s | vs hf |\n|---|---|---|---|---|")
    for r in results:
        rate = r["tokens"] / r["seconds"]
        print(f"| {r['case']} | {r['tokens']} | {r['seconds']:.2f} | {rate:.0f} | {rate / base_rate:.2f}x |")


if __name__ == "__main__":
    main()
