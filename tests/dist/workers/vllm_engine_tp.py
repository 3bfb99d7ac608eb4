"""Worker for the engine-TP test (run under torchrun, 2 processes): one vLLM engine at engine TP=2 across
both ranks (external_launcher), started without weights, given them by a push, then greedy decoding.

    torchrun --nproc_per_node 2 vllm_engine_tp.py HF_DIR OUT_PREFIX

Each rank saves {"greedy": [[ids]]} to OUT_PREFIX.<rank>.pt: both ranks of an engine group must agree.
"""

import sys

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from dapo_mcore.rollout.base import EngineSettings, SamplingParams
from dapo_mcore.rollout.registry import create_engine
from tests.engines.test_engine_contract import PROMPTS


def main():
    hf_dir, out = sys.argv[1:3]
    dist.init_process_group("gloo")  # as the trainer has it before the engine starts
    settings = EngineSettings(model_path=hf_dir, tp_size=2, load_weights=False, cpu_kv_cache_mb=128)
    engine = create_engine("vllm", settings)
    engine.update_weights(load_file(f"{hf_dir}/model.safetensors").items())
    tokenizer = engine.inner.tokenizer
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    greedy = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=24))
    torch.save({"greedy": [g[0].token_ids.tolist() for g in greedy]}, f"{out}.{dist.get_rank()}.pt")
    engine.shutdown()  # at engine TP > 1 vLLM's shutdown also ends the default process group
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
