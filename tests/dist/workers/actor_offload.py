"""Worker for the rollout-offload test (one process, run under torchrun): two identical bf16 actors with the
distributed optimizer take an update each; one then goes through offload_for_rollout / restore_after_rollout
before its second update, the other does not.

    torchrun --nproc_per_node 1 actor_offload.py HF_DIR OUT

Result (saved to OUT), taken while offloaded unless said: "state_released" per Adam moment (no reference to
the old tensor is left), "main_params_moved" per optimizer param (its storage changed, it views the model's
own storage), "same_objects" (the optimizer's params are the objects its state and the model's main_param
handles know), "model_params_kept", "host_copy_equal", after the restore "restored_equal" (bit for bit, on
the device) and "weights": {"offload": ..., "plain": ...} the model's weights after the second update.
"""

import argparse
import dataclasses
import gc
import weakref

import torch

from dapo_mcore.checkpoint.convert import LlamaFamilyMap
from dapo_mcore.checkpoint.hf_io import load_hf_weights
from dapo_mcore.config.model_spec import load_hf_config, read_model_spec
from dapo_mcore.mcore.actor import ActorSettings, OptimizerSettings, build_actor
from dapo_mcore.mcore.provider import build_gpt_chunks, build_transformer_config
from dapo_mcore.parallel import destroy_parallel, init_parallel
from tests.helpers import random_samples


def build(ctx, hf_dir):
    spec = read_model_spec(load_hf_config(hf_dir))
    config = build_transformer_config(spec, tp=1, pp=1, dtype="float32", on_cpu=True, use_te=False)
    # bf16 weights, so the optimizer keeps fp32 main params of its own (the CPU mode's config refuses bf16
    # only because it is slow there; these few tiny steps are fine)
    config = dataclasses.replace(
        config, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, calculate_per_token_loss=True
    )
    chunks = build_gpt_chunks(spec, config, ctx=ctx, use_te=False)
    family = LlamaFamilyMap(spec, te_layer_names=False)
    load_hf_weights(chunks, hf_dir, family, 0, 1)
    opt = OptimizerSettings(
        lr=1e-2, min_lr=0.0, warmup_steps=0, total_steps=4, weight_decay=0.1, clip_grad=1.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, use_distributed_optimizer=True,
    )  # fmt: skip
    settings = ActorSettings(micro_batch_size=8, temperature=1.0, pad_id=0)
    actor = build_actor(ctx, spec, chunks, opt, settings)
    return actor


def optimizer_tensors(actor):
    """(kind, tensor) for every tensor the (single, distributed) optimizer holds."""
    inner = actor.optimizer.optimizer
    out = [("state", v) for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return out + [("main_params", p) for group in inner.param_groups for p in group["params"]]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir")
    ap.add_argument("out")
    args = ap.parse_args()
    ctx = init_parallel(1, 1, "cpu")
    samples, batches = random_samples(16, seed=7), [list(range(16))]
    actors = {name: build(ctx, args.hf_dir) for name in ("offload", "plain")}
    for actor in actors.values():
        actor.train_step(actor.prepare(samples, batches))  # Adam state exists from here on

    actor = actors["offload"]
    before = [(kind, t, t.detach().clone(), t.untyped_storage().data_ptr()) for kind, t in optimizer_tensors(actor)]
    model = {p.untyped_storage().data_ptr() for chunk in actor.chunks for p in chunk.parameters()}
    # Adam's moments; its step counters (0-dim) stay on the host (a CUDA step breaks a non-capturable Adam)
    state_refs = [weakref.ref(t) for kind, t, _, _ in before if kind == "state" and t.dim() > 0]
    n_state = len(state_refs)
    before = [(kind, None if kind == "state" else t, copy, ptr) for kind, t, copy, ptr in before]
    gc.collect()
    actor.offload_for_rollout()
    gc.collect()
    now = optimizer_tensors(actor)
    result = {
        "n_state": n_state,
        "n_main_params": sum(kind == "main_params" for kind, *_ in before),
        # the old state tensors are gone (nothing holds them: their storage went back to the allocator)
        "state_released": [ref() is None for ref in state_refs],
        # fp32 main params of bf16 weights: moved; fp32 weights' shards (views of the model's own storage): kept
        "main_params_moved": [
            (t.untyped_storage().data_ptr() != ptr, ptr in model) for kind, t, _, ptr in before if kind == "main_params"
        ],
        "same_objects": all(t is old for (_, t), (_, old, _, _) in zip(now, before) if old is not None),
        "model_params_kept": model == {p.untyped_storage().data_ptr() for c in actor.chunks for p in c.parameters()},
        "host_copy_equal": [torch.equal(t, copy) for (_, t), (_, _, copy, _) in zip(now, before)],
    }
    actor.restore_after_rollout()
    result["restored_equal"] = [
        torch.equal(t, copy) and t.device == ctx.device
        for (_, t), (_, _, copy, _) in zip(optimizer_tensors(actor), before)
    ]
    result["weights"] = {}
    for name, actor in actors.items():
        actor.train_step(actor.prepare(samples, batches))
        result["weights"][name] = {n: p.detach().clone() for n, p in actor.chunks[0].named_parameters()}
    torch.save(result, args.out)
    destroy_parallel()


if __name__ == "__main__":
    main()
