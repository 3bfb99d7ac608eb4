"""Worker for the parallel-layout tests (run under torchrun): the actor's loss, per-token log-probs and full
HF-named gradients for a fixed batch, saved by rank 0 to --out.

    torchrun --nproc_per_node N actor_grads.py HF_DIR OUT --tp 2 --pp 1 --micro-batch-sizes 4
"""

import argparse
import copy
import dataclasses

import torch
import torch.distributed as dist

from dapo_mcore.checkpoint.convert import LlamaFamilyMap
from dapo_mcore.checkpoint.hf_io import load_hf_weights
from dapo_mcore.mcore.actor import ActorSettings, OptimizerSettings, build_actor
from dapo_mcore.mcore.provider import build_gpt_chunks, build_transformer_config, load_hf_config, read_model_spec
from dapo_mcore.parallel import all_gather_objects, destroy_parallel, init_parallel
from dapo_mcore.weight_sync import WeightExporter
from tests.helpers import random_samples


def build(hf_dir, tp, pp, mbs, fused=True):
    ctx = init_parallel(tp, pp, "cpu")
    spec = read_model_spec(load_hf_config(hf_dir))
    config = build_transformer_config(spec, tp=tp, pp=pp, dtype="float32", on_cpu=True, use_te=False)
    chunks = build_gpt_chunks(spec, config, pg=ctx.pg, pre_process=ctx.is_first_stage,
                              post_process=ctx.is_last_stage, use_te=False, tp=tp)
    family = LlamaFamilyMap(spec)
    load_hf_weights(chunks, hf_dir, family, ctx.tp_rank, tp)
    opt = OptimizerSettings(lr=1e-3, min_lr=0.0, warmup_steps=0, total_steps=1, weight_decay=0.0, clip_grad=0.0,
                            adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, use_distributed_optimizer=False)
    # chunk=5 tokens: many chunks per micro-batch, so the chunk loop itself is exercised
    settings = ActorSettings(micro_batch_size=mbs, temperature=0.9, pad_id=0, fused_logprobs=fused, logprob_chunk_size=5)
    actor = build_actor(ctx, spec, chunks, opt, settings)
    return ctx, actor, WeightExporter(ctx, actor.chunks, family)


def loss_of(ctx, totals):
    totals = totals.clone()
    dist.all_reduce(totals, group=ctx.pg.dp)
    dist.all_reduce(totals, group=ctx.pg.pp)
    return (totals[0] / totals[1]).item()  # sum_keys: loss numerator, denominator, ...


def token_logprobs(ctx, actor, samples):
    fresh = copy.deepcopy(samples)
    for s in fresh:
        s.old_logprobs = None
    actor.fill_logprobs(fresh, [list(range(len(fresh)))], "old_logprobs")
    mine = {i: s.old_logprobs for i, s in enumerate(fresh) if s.old_logprobs is not None}
    merged = {}
    for part in all_gather_objects(mine):
        merged.update(part)
    return [merged[i] for i in range(len(samples))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir")
    ap.add_argument("out")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--micro-batch-sizes", default="4")
    ap.add_argument("--loss-agg-modes", default="token-mean")
    ap.add_argument("--naive-logprobs", action="store_true", help="full logits instead of the fused head")
    ap.add_argument("--samples", type=int, default=16)
    args = ap.parse_args()
    sizes = [int(x) for x in args.micro_batch_sizes.split(",")]
    ctx, actor, exporter = build(args.hf_dir, args.tp, args.pp, sizes[0], fused=not args.naive_logprobs)
    samples = random_samples(args.samples, seed=7)
    result = {"logprobs": token_logprobs(ctx, actor, samples), "runs": {},
              "weights": {name: t.clone() for name, t in exporter.hf_weights()}}
    for mode in args.loss_agg_modes.split(","):
        for mbs in sizes:
            loss = dataclasses.replace(actor.settings.loss, agg_mode=mode, norm_len=13)
            actor.settings = dataclasses.replace(actor.settings, micro_batch_size=mbs, loss=loss)
            totals = actor.compute_gradients(samples, list(range(len(samples))))
            grads = {name: t.clone() for name, t in exporter.hf_weights(grads=True)}
            result["runs"][f"{mode}/{mbs}"] = {"loss": loss_of(ctx, totals), "grads": grads}
    if ctx.rank == 0:
        torch.save(result, args.out)
    destroy_parallel()


if __name__ == "__main__":
    main()
