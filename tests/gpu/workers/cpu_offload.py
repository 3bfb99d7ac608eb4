"""Worker for the optimizer.cpu_offload test (one process on CUDA, run under torchrun): a bf16 actor with the
distributed optimizer and optimizer.cpu_offload takes two updates.

    torchrun --nproc_per_node 1 cpu_offload.py HF_DIR OUT

Saved to OUT: "main_params_on_gpu" (fp32 main parameters the distributed optimizer keeps on the GPU: none with
Megatron's precision-aware path), "state_devices" (the devices of every optimizer state tensor), "moved" (the
weights changed), "gpu_bytes" (memory allocated after the updates) and "weight_bytes" (the model's).
"""

import argparse

import torch

from dapo_mcore.checkpoint.convert import LlamaFamilyMap
from dapo_mcore.checkpoint.hf_io import load_hf_weights
from dapo_mcore.config.model_spec import load_hf_config, read_model_spec
from dapo_mcore.mcore.actor import ActorSettings, OptimizerSettings, build_actor
from dapo_mcore.mcore.provider import build_gpt_chunks, build_transformer_config
from dapo_mcore.parallel import destroy_parallel, init_parallel
from tests.helpers import random_samples


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir")
    ap.add_argument("out")
    args = ap.parse_args()
    ctx = init_parallel(1, 1, "cuda")
    spec = read_model_spec(load_hf_config(args.hf_dir))
    config = build_transformer_config(spec, tp=1, pp=1, dtype="bfloat16", on_cpu=False, use_te=False)
    chunks = build_gpt_chunks(spec, config, ctx=ctx, use_te=False)
    load_hf_weights(chunks, args.hf_dir, LlamaFamilyMap(spec, te_layer_names=False), 0, 1)
    opt = OptimizerSettings(
        lr=1e-2, min_lr=0.0, warmup_steps=0, total_steps=4, weight_decay=0.1, clip_grad=1.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, use_distributed_optimizer=True, cpu_offload=True,
    )  # fmt: skip
    actor = build_actor(ctx, spec, chunks, opt, ActorSettings(micro_batch_size=8, temperature=1.0, pad_id=0))
    before = {n: p.detach().clone() for n, p in actor.chunks[0].named_parameters()}
    samples = random_samples(16, seed=7)
    for _ in range(2):
        actor.train_step(actor.prepare(samples, [list(range(16))]))
    params = [p for chunk in actor.chunks for p in chunk.parameters()]
    state = [v for s in actor.optimizer.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    result = {
        "main_params_on_gpu": sum(
            1 for p in params if getattr(p, "main_param", None) is not None and p.main_param.is_cuda
        ),
        "state_devices": sorted({t.device.type for t in state if t.dim() > 0}),
        "moved": any(not torch.equal(before[n], p) for n, p in actor.chunks[0].named_parameters()),
        "gpu_bytes": torch.cuda.memory_allocated(),
        "weight_bytes": sum(p.numel() * p.element_size() for p in params),
    }
    torch.save(result, args.out)
    destroy_parallel()


if __name__ == "__main__":
    main()
