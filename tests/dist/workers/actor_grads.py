"""Worker for the parallel-layout tests (run under torchrun): the actor's loss, per-token log-probs and full
HF-named gradients for a fixed batch, saved by rank 0 to --out.

    torchrun --nproc_per_node N actor_grads.py HF_DIR OUT --tp 2 --pp 2 --vpp 2 --cp 2 --micro-batch-sizes 4
             [--sp] [--max-tokens 0,64] [--loss-agg-modes token-mean,...] [--naive-logprobs]
             [--recompute-logits] [--entropy-coeffs 0,0.01] [--optimizer-step --dist-opt]
             [--packing off,mask --varied-samples]
             [--ep 2 --etp 1 --moe-aux-loss 0.001 --moe-dispatcher allgather --routing-replay]
    torchrun --nproc_per_node N actor_grads.py --batch RUNS.json    # a JSON list of the argument lists above

A batch builds its layouts one after another in the same processes (Megatron's groups made anew for each,
torch.distributed's kept): the interpreter and import start-up is paid once per launch.

Result: {"logprobs": per-sample old log-probs, "weights": HF-named weights as loaded,
         "logprobs_<packing>": the same per packing mode (with --packing),
         "runs": {"<mode>/<micro batch size>/<token budget>[/<packing>][/entropy <coeff>]": {"loss", "grads"}}
                 (no packing suffix: off),
         "stepped": HF-named weights after one optimizer step (with --optimizer-step)}.
"""

import argparse
import contextlib
import copy
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dapo_mcore.checkpoint.convert import LlamaFamilyMap
from dapo_mcore.checkpoint.hf_io import load_hf_weights
from dapo_mcore.config.model_spec import load_hf_config, read_model_spec
from dapo_mcore.data.types import NO_EXPERT, ROUTING_DTYPE
from dapo_mcore.mcore.actor import ActorSettings, OptimizerSettings, build_actor
from dapo_mcore.mcore.provider import build_gpt_chunks, build_transformer_config
from dapo_mcore.parallel import all_gather_objects, destroy_parallel, init_parallel
from dapo_mcore.weight_sync import WeightExporter
from tests.helpers import random_samples


def build(args, mbs):
    ctx = init_parallel(args.tp, args.pp, args.device, vpp=args.vpp, ep=args.ep, etp=args.etp, cp=args.cp)
    if ctx.device.type == "cuda":  # fp32 comparisons: no TF32 matmuls
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    spec = read_model_spec(load_hf_config(args.hf_dir))
    config = build_transformer_config(
        spec,
        tp=args.tp,
        pp=args.pp,
        dtype=args.dtype,
        on_cpu=ctx.is_cpu,
        use_te=args.te,
        vpp=args.vpp,
        sequence_parallel=args.sp,
        recompute=args.recompute,
        fp8=args.fp8,
        fp8_recipe=args.fp8_recipe,
        ep=args.ep,
        etp=args.etp,
        moe_aux_loss_coeff=args.moe_aux_loss,
        moe_dispatcher=args.moe_dispatcher,
        cp=args.cp,
    )
    chunks = build_gpt_chunks(spec, config, ctx=ctx, use_te=args.te)
    family = LlamaFamilyMap(spec, te_layer_names=args.te)
    load_hf_weights(chunks, args.hf_dir, family, ctx.tp_rank, args.tp, ctx.etp_rank, ctx.etp_size)
    # Adam with eps=1: the first update is ~ lr * g, linear in the gradient, so layouts can be compared to
    # round-off (with eps=1e-8 it is ~ lr * sign(g), which turns 1e-9 gradient noise into lr-sized jumps).
    opt = OptimizerSettings(
        lr=1.0,
        min_lr=0.0,
        warmup_steps=0,
        total_steps=1,
        weight_decay=0.1,
        clip_grad=0.05,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_eps=1.0,
        use_distributed_optimizer=args.dist_opt,
    )
    # chunk=5 tokens: many chunks per micro-batch, so the chunk loop itself is exercised
    settings = ActorSettings(
        micro_batch_size=mbs,
        temperature=0.9,
        pad_id=0,
        fused_logprobs=not args.naive_logprobs,
        logprob_chunk_size=5,
        fused_loss_grad=not args.recompute_logits,
        packing=args.packing.split(",")[0],  # the first layout is the reference of the others
        routing_replay=args.routing_replay,
    )
    actor = build_actor(ctx, spec, chunks, opt, settings)
    return ctx, actor, WeightExporter(ctx, actor.chunks, family)


def loss_of(ctx, totals):
    totals = totals.to(ctx.device)  # NCCL reduces GPU tensors only
    dist.all_reduce(totals, group=ctx.pg.dp_cp)  # CP ranks hold other columns of the same samples
    dist.all_reduce(totals, group=ctx.pg.pp)
    return (totals[0] / totals[1]).item()  # sum_keys: loss numerator, denominator, ...


def varied_samples(budget):
    """Lengths far apart: random short samples, one with a single response token, one of 40 tokens and one
    exactly as long as the token budget (it fills a packed row alone)."""
    samples = random_samples(14, seed=7)
    for length, n_resp in ((40, 30), (budget, budget - 6)):
        extra = random_samples(1, seed=length, max_prompt=2, max_response=1)[0]
        extra.prompt_ids = (extra.prompt_ids * length)[: length - n_resp]
        extra.response_ids = [4 + (7 * j) % 90 for j in range(n_resp)]
        extra.rollout_logprobs = [-4.6] * n_resp
        extra.old_logprobs = [-4.6 + 0.01 * (j % 30) for j in range(n_resp)]
        samples.append(extra)
    one = samples[3]
    one.response_ids, one.rollout_logprobs, one.old_logprobs = one.response_ids[:1], [-4.6], [-4.5]
    one.trainable = True
    return samples


def add_routing(samples, spec) -> None:
    """Engine routing as a replaying actor gets it: top-k distinct experts per token and sparse layer (uint8),
    a third of the tokens unknown (NO_EXPERT: the router's own choice), NO_EXPERT in dense layers. The same on
    every rank."""
    gen = torch.Generator().manual_seed(11)
    for s in samples:
        rows = len(s.prompt_ids) + len(s.response_ids) - 1
        routed = torch.full((rows, spec.num_layers, spec.moe_topk), NO_EXPERT, dtype=ROUTING_DTYPE)
        for layer in (i for i, sparse in enumerate(spec.moe_layers) if sparse):
            ids = torch.rand(rows, spec.num_experts, generator=gen).argsort(dim=-1)[:, : spec.moe_topk]
            known = torch.rand(rows, generator=gen) > 1 / 3
            routed[known, layer] = ids[known].to(ROUTING_DTYPE)
        s.routed_experts = routed


def token_logprobs(actor, samples):
    fresh = copy.deepcopy(samples)
    for s in fresh:
        s.old_logprobs = None
    actor.fill_logprobs(fresh, [list(range(len(fresh)))], "old_logprobs")
    mine = {i: s.old_logprobs for i, s in enumerate(fresh) if s.old_logprobs is not None}
    merged = {}
    for part in all_gather_objects(mine):
        merged.update(part)
    return [merged[i] for i in range(len(samples))]


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().float().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir")
    ap.add_argument("out")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1, help="context parallel (each sequence split over CP ranks)")
    ap.add_argument("--sp", action="store_true", help="sequence parallel")
    ap.add_argument("--ep", type=int, default=1, help="expert parallel (a MoE model)")
    ap.add_argument("--etp", type=int, default=0, help="expert tensor parallel (0: TP)")
    ap.add_argument("--moe-aux-loss", type=float, default=0.0, help="load-balancing loss coefficient (MoE)")
    ap.add_argument("--moe-dispatcher", default="alltoall", choices=["alltoall", "allgather"])
    ap.add_argument("--routing-replay", action="store_true", help="samples carry engine routing, replayed (MoE)")
    ap.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--te", action="store_true", help="Transformer Engine layers (GPU)")
    ap.add_argument("--fp8", default="none")
    ap.add_argument("--fp8-recipe", default="blockwise")
    ap.add_argument("--micro-batch-sizes", default="4")
    ap.add_argument("--max-tokens", default="0", help="token budgets per micro-batch (0: micro-batch sizes)")
    ap.add_argument("--loss-agg-modes", default="token-mean")
    ap.add_argument("--naive-logprobs", action="store_true", help="full logits instead of the fused head")
    ap.add_argument(
        "--recompute-logits",
        action="store_true",
        help="fused head without the loss gradient in its forward: backward recomputes logits",
    )
    ap.add_argument("--entropy-coeffs", default="0", help="entropy bonus coefficients to run (0: none)")
    ap.add_argument("--policy-losses", default="dapo", help="algorithm.policy_loss values to run (gspo: wide band)")
    ap.add_argument("--tis", default="none", help="the rollout correction of every run (algorithm.mismatch.tis)")
    ap.add_argument("--optimizer-step", action="store_true", help="also take one optimizer step, save weights")
    ap.add_argument("--dist-opt", action="store_true", help="Megatron's distributed optimizer")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--packing", default="off", help="packing modes to run (off, mask, thd)")
    ap.add_argument("--equal-samples", action="store_true", help="every sample 16 tokens (rows without padding)")
    ap.add_argument("--varied-samples", action="store_true", help="lengths up to the largest token budget")
    return ap


def run(args) -> None:
    sizes = [int(x) for x in args.micro_batch_sizes.split(",")]
    ctx, actor, exporter = build(args, sizes[0])
    budgets, packings = [int(x) for x in args.max_tokens.split(",")], args.packing.split(",")
    samples = varied_samples(max(budgets)) if args.varied_samples else random_samples(args.samples, seed=7)
    if args.equal_samples:  # every row 16 tokens: padded rows without padding (a multiple of 2 CP x TP)
        for sample in samples:
            sample.prompt_ids = (sample.prompt_ids * 4)[:4]
            sample.response_ids = (sample.response_ids * 12)[:12]
            sample.rollout_logprobs = (sample.rollout_logprobs * 12)[:12]
            sample.old_logprobs = (sample.old_logprobs * 12)[:12]
    if args.routing_replay:
        add_routing(samples, actor.spec)
    gpt = actor.chunks[0].module
    result = {
        "logprobs": token_logprobs(actor, samples),
        "runs": {},
        "rope_inv_freq": gpt.rotary_pos_emb.inv_freq.clone() if hasattr(gpt, "rotary_pos_emb") else None,
        "weights": {name: t.clone() for name, t in exporter.hf_weights()},
    }
    for packing in packings[1:]:
        actor.settings = dataclasses.replace(actor.settings, packing=packing)
        result[f"logprobs_{packing}"] = token_logprobs(actor, samples)
    runs = itertools.product(args.loss_agg_modes.split(","), budgets, sizes, packings, args.entropy_coeffs.split(","),
                             args.policy_losses.split(","))  # fmt: skip
    for mode, budget, mbs, packing, entropy, policy_loss in runs:
        wide_gspo_band = {"gspo_clip_low": 0.2, "gspo_clip_high": 0.28}  # the paper's clips nearly every sequence
        loss = dataclasses.replace(actor.settings.loss, agg_mode=mode, norm_len=13, entropy_coeff=float(entropy),
                                   policy_loss=policy_loss, tis=args.tis, **wide_gspo_band)  # fmt: skip
        actor.settings = dataclasses.replace(
            actor.settings, micro_batch_size=mbs, loss=loss, max_tokens_per_micro_batch=budget, packing=packing
        )
        router = actor.router_metrics
        with router.collecting() if router is not None else contextlib.nullcontext():
            totals = actor.compute_gradients(samples, list(range(len(samples))))
        grads = {name: t.clone() for name, t in exporter.hf_weights(grads=True)}
        key = f"{mode}/{mbs}/{budget}" + ("" if packing == "off" else f"/{packing}")
        key += f"/entropy {entropy}" if float(entropy) else ""
        key += "" if policy_loss == "dapo" else f"/{policy_loss}"
        result["runs"][key] = {"loss": loss_of(ctx, totals), "grads": grads,
                               "router": router.metrics() if router is not None else {}}  # fmt: skip
    if args.optimizer_step:
        actor.settings = dataclasses.replace(
            actor.settings,
            micro_batch_size=sizes[0],
            max_tokens_per_micro_batch=0,
            packing=packings[0],
            loss=dataclasses.replace(actor.settings.loss, agg_mode="token-mean"),
        )
        actor.train_step(actor.prepare(samples, [list(range(len(samples)))]))
        result["stepped"] = {name: t.clone() for name, t in exporter.hf_weights()}
    if ctx.rank == 0:
        torch.save(_to_cpu(result), args.out)


def main():
    from megatron.core import parallel_state as mpu

    if sys.argv[1:2] == ["--batch"]:
        for argv in json.loads(Path(sys.argv[2]).read_text()):
            run(parser().parse_args(argv))
            mpu.destroy_model_parallel()  # the next layout makes its own groups
    else:
        run(parser().parse_args())
    destroy_parallel()


if __name__ == "__main__":
    main()
