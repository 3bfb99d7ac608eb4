#!/usr/bin/env python
"""Actor training throughput against Megatron-Core's own forward/backward, same model and shapes, same run.

    python tools/bench_actor.py --hf examples/models/tiny-arith --seq 256 --micro-batch 8 --micro-batches 4
    torchrun --nproc_per_node 8 tools/bench_actor.py --hf /models/Qwen2.5-7B --tp 4 --seq 4096 --dtype bfloat16

For each of --steps timed steps (after --warmup), taking turns: ours runs MegatronActor.compute_gradients
(log-prob head + DAPO loss, Megatron schedules and DDP; one model per head of HEADS) on random responses
filling the sequence; the baseline runs get_forward_backward_func() on a GPTModel built from the same
config, with Megatron's vocab-parallel cross-entropy as the loss. Prints tokens/s and model TFLOP/s per
rank (matmul FLOPs of forward + backward: 3x the forward's, causal attention counted at half) and the
ratio ours/baseline. Use a config.json alone (random weights) or a full HF directory.

--long-cot N: instead, N samples with log-normal lengths in [--min-len, --max-len] (long-CoT-like), one
mini-batch, trained padded to one length (micro_batch_size rows), padded by a token budget, and packed into
rows of that budget (trainer.packing): real tokens/s and padding efficiency (real / computed tokens) of each.

--fp8 e4m3|hybrid (Transformer Engine on a GPU): instead, the actor with the default head in --dtype against
the same actor with FP8 linear layers (--fp8-recipe), the first one as the baseline.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from dapo_mcore.algo.losses import LossSettings
from dapo_mcore.config.model_spec import load_hf_config, read_model_spec
from dapo_mcore.data.types import Sample
from dapo_mcore.mcore.actor import ActorSettings, OptimizerSettings, build_actor
from dapo_mcore.mcore.provider import build_gpt_chunks, build_transformer_config, resolve_transformer_impl
from dapo_mcore.parallel import destroy_parallel, init_parallel

BASELINE = "Megatron-Core fwd/bwd + CE (baseline)"
# The actor's log-prob heads (ActorSettings overrides): the default takes the loss's per-token gradient in
# the fused head's forward (one [chunk, V] buffer without an entropy term in the loss, two with one); the
# next recomputes each chunk's logits in backward; the last keeps full logits.
HEADS = {
    "dapo_mcore actor, fused head, loss gradient in its forward": {},
    "dapo_mcore actor, fused head, loss gradient in its forward, entropy bonus in the loss": {
        "loss": LossSettings(entropy_coeff=0.01)
    },
    "dapo_mcore actor, fused head, logits recomputed in backward": {"fused_loss_grad": False},
    "dapo_mcore actor, full-logits head": {"fused_logprobs": False},
}


def flops_per_token(spec, seq: int) -> float:
    """Forward + backward matmul FLOPs per trained token."""
    h, q, kv, f = (
        spec.hidden_size,
        spec.num_heads * spec.head_dim,
        spec.num_kv_heads * spec.head_dim,
        spec.ffn_hidden_size,
    )
    per_layer = 2 * (h * (q + 2 * kv) + q * h + 3 * h * f) + 2 * 2 * (seq / 2) * q
    return 3 * (spec.num_layers * per_layer + 2 * h * spec.vocab_size)


def synthetic_samples(n: int, seq: int, vocab: int, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    prompt_len = seq // 8
    samples = []
    for _ in range(n):
        ids = torch.randint(4, vocab, (seq,), generator=g).tolist()
        samples.append(
            Sample(
                prompt_ids=ids[:prompt_len],
                response_ids=ids[prompt_len:],
                rollout_logprobs=[-1.0] * (seq - prompt_len),
                finish_reason="length",
                advantage=float(torch.randn(1, generator=g)),
                old_logprobs=[-1.0] * (seq - prompt_len),
            )
        )
    return samples


def long_cot_samples(n: int, low: int, high: int, vocab: int, seed: int = 0) -> list[Sample]:
    """Log-normal total lengths (median sqrt(low * high), ~95% inside [low, high]), clipped to the range;
    prompts of 1/8 of the shortest, the rest response."""
    rng = random.Random(seed)
    mu, sigma = (math.log(low) + math.log(high)) / 2, (math.log(high) - math.log(low)) / 4
    samples = []
    for _ in range(n):
        length = min(high, max(low, round(rng.lognormvariate(mu, sigma))))
        ids = [rng.randrange(4, vocab) for _ in range(length)]
        n_resp = length - low // 8
        samples.append(
            Sample(
                prompt_ids=ids[: low // 8],
                response_ids=ids[low // 8 :],
                rollout_logprobs=[-1.0] * n_resp,
                finish_reason="stop",
                advantage=rng.uniform(-1, 1),
                old_logprobs=[-1.0] * n_resp,
            )
        )
    return samples


def bench_long_cot(args, actor, ctx) -> None:
    """Padded vs packed on one long-tailed mini-batch: real tokens/s and padding efficiency."""
    samples = long_cot_samples(args.long_cot, args.min_len, args.max_len, actor.spec.vocab_size)
    indices, budget = list(range(len(samples))), args.max_len
    layouts = {
        f"padded: {args.micro_batch} rows x the longest sample": dict(packing="off", max_tokens_per_micro_batch=0),
        f"padded: token budget {budget}": dict(packing="off", max_tokens_per_micro_batch=budget),
        f"packed: rows of {budget} tokens (trainer.packing)": dict(packing="mask", max_tokens_per_micro_batch=budget),
    }
    real, rows = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples), []
    for name, changes in layouts.items():
        actor.settings = dataclasses.replace(actor.settings, **changes)
        secs, efficiency = _time_layout(actor, samples, indices, args, ctx)
        rows.append((name, secs, real / secs, efficiency))
    if ctx.rank == 0:
        lengths = sorted(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        spread = f"{lengths[0]}/{lengths[len(lengths) // 2]}/{lengths[-1]}"
        print(f"{len(samples)} samples, {real} tokens, lengths min/median/max {spread} | {ctx.describe()}")
        print("| layout | s/step | real tokens/s | padding efficiency | speed-up vs padded |")
        print("|---|---|---|---|---|")
        for name, secs, tps, eff in rows:
            print(f"| {name} | {secs:.2f} | {tps:.0f} | {eff:.2f} | {rows[0][1] / secs:.2f} |")


def _time_layout(actor, samples, indices, args, ctx) -> tuple[float, float]:
    """Median seconds per mini-batch and real / computed tokens (the actor's own counts)."""
    totals = {}

    def step():
        totals.update(zip(actor.sum_keys, actor.compute_gradients(samples, indices).tolist()))

    secs = statistics.median(time_in_turns({"layout": step}, args.steps, args.warmup, ctx.device)["layout"])
    return secs, totals["real_tokens"] / totals["computed_tokens"]


def time_in_turns(loops: dict, steps: int, warmup: int, device: torch.device) -> dict[str, list[float]]:
    """Seconds per step of each loop, the loops taking turns step by step: when the machine's load changes
    during the run (other jobs on a shared host), every loop sees it alike and the ratios still hold."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = {name: [] for name in loops}
    for i in range(warmup + steps):
        for name, step in loops.items():
            sync()
            start = time.perf_counter()
            step()
            sync()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def megatron_baseline(spec, config, ctx, samples, seq: int, mbs: int, use_te: bool):
    """Megatron-Core's own loop on a second model: tokens -> GPTModel(labels) -> per-token CE."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = build_gpt_chunks(spec, config, ctx=ctx, use_te=use_te)
    ddp = [
        DistributedDataParallel(
            config=config,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
            module=m,
            pg_collection=ctx.pg,
        )
        for m in model
    ]
    config.finalize_model_grads_func = finalize_model_grads
    tokens = torch.tensor([s.prompt_ids + s.response_ids for s in samples], device=ctx.device)
    micro = [tokens[i : i + mbs] for i in range(0, len(samples), mbs)]
    positions = torch.arange(seq, device=ctx.device).expand(mbs, seq)

    def step_fn(data_iterator, module):
        batch = next(data_iterator)
        labels = torch.roll(batch, -1, dims=1)
        out = module(batch, positions, None, labels=labels)  # [b, s] per-token CE

        def loss(output):
            return output.sum(), torch.tensor(output.numel(), dtype=torch.int, device=output.device), {}

        return out, loss

    def run():
        for chunk in ddp:
            chunk.zero_grad_buffer()
        get_forward_backward_func(pp_size=ctx.pp_size)(
            forward_step_func=step_fn,
            data_iterator=iter(micro),
            model=ddp,
            num_microbatches=len(micro),
            seq_length=seq,
            micro_batch_size=mbs,
            forward_only=False,
        )

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", required=True, help="HF directory or config.json (random weights either way)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dtype", default="float32" if not torch.cuda.is_available() else "bfloat16")
    ap.add_argument("--transformer-impl", default="auto", choices=["auto", "local", "transformer_engine"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--long-cot", type=int, default=0, help="N long-tailed samples: padded vs packed")
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--fp8", default="none", choices=["none", "e4m3", "hybrid"], help="bf16 vs FP8 actor (TE)")
    ap.add_argument("--fp8-recipe", default="blockwise", choices=["delayed", "tensorwise", "blockwise", "mxfp8"])
    args = ap.parse_args()
    hf = Path(args.hf)
    spec = read_model_spec(load_hf_config(hf.parent if hf.name == "config.json" else hf))
    ctx = init_parallel(args.tp, args.pp, "auto", seed=0)
    use_te = resolve_transformer_impl(args.transformer_impl, ctx.is_cpu)

    def model_config(**fp8):  # one per model: Megatron's schedules write into it
        return build_transformer_config(
            spec, tp=args.tp, pp=args.pp, dtype=args.dtype, on_cpu=ctx.is_cpu, use_te=use_te, **fp8
        )

    samples = synthetic_samples(args.micro_batch * args.micro_batches * ctx.dp_size, args.seq, spec.vocab_size)
    opt = OptimizerSettings(
        lr=1e-5,
        min_lr=0.0,
        warmup_steps=0,
        total_steps=1,
        weight_decay=0.0,
        clip_grad=1.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_eps=1e-8,
        use_distributed_optimizer=True,
    )
    if args.long_cot:
        settings = ActorSettings(micro_batch_size=args.micro_batch, temperature=1.0, pad_id=0)
        actor = build_actor(ctx, spec, build_gpt_chunks(spec, model_config(), ctx=ctx, use_te=use_te), opt, settings)
        bench_long_cot(args, actor, ctx)
        destroy_parallel()
        return
    if args.fp8 != "none":
        bench_fp8(args, spec, ctx, model_config, opt, samples, use_te)
        destroy_parallel()
        return
    loops = {}
    for name, overrides in HEADS.items():
        # padded rows, as Megatron-Core's own loop runs them
        settings = ActorSettings(
            micro_batch_size=args.micro_batch, temperature=1.0, pad_id=0, packing="off", **overrides
        )
        actor = build_actor(ctx, spec, build_gpt_chunks(spec, model_config(), ctx=ctx, use_te=use_te), opt, settings)
        loops[name] = partial(actor.compute_gradients, samples, list(range(len(samples))))
    loops[BASELINE] = megatron_baseline(
        spec, model_config(), ctx, samples[: args.micro_batch * args.micro_batches], args.seq, args.micro_batch, use_te
    )
    times = time_in_turns(loops, args.steps, args.warmup, ctx.device)
    seconds = {name: statistics.median(t) for name, t in times.items()}
    report(args, spec, ctx, seconds)
    destroy_parallel()


def bench_fp8(args, spec, ctx, model_config, opt, samples, use_te: bool) -> None:
    """The default actor in --dtype against the same actor with FP8 linear layers (Transformer Engine)."""
    settings = ActorSettings(micro_batch_size=args.micro_batch, temperature=1.0, pad_id=0, packing="off")
    configs = {
        f"dapo_mcore actor, {args.dtype} (baseline)": {},
        f"dapo_mcore actor, FP8 {args.fp8} {args.fp8_recipe}": dict(fp8=args.fp8, fp8_recipe=args.fp8_recipe),
    }
    loops = {}
    for name, fp8 in configs.items():
        chunks = build_gpt_chunks(spec, model_config(**fp8), ctx=ctx, use_te=use_te)
        actor = build_actor(ctx, spec, chunks, opt, settings)
        loops[name] = partial(actor.compute_gradients, samples, list(range(len(samples))))
    times = time_in_turns(loops, args.steps, args.warmup, ctx.device)
    report(args, spec, ctx, {name: statistics.median(t) for name, t in times.items()}, baseline=next(iter(loops)))


def report(args, spec, ctx, seconds: dict[str, float], baseline: str = BASELINE) -> None:
    if ctx.rank != 0:
        return
    tokens = args.micro_batch * args.micro_batches * args.seq  # per data-parallel replica and step
    per_rank = tokens / (ctx.tp_size * ctx.pp_size)
    flops = flops_per_token(spec, args.seq) * per_rank
    device = torch.cuda.get_device_name() if ctx.device.type == "cuda" else "CPU"
    print(
        f"{spec.model_type} h={spec.hidden_size} L={spec.num_layers} V={spec.vocab_size} | {ctx.describe()} | "
        f"{device} {args.dtype} | seq {args.seq} x {args.micro_batch} x {args.micro_batches} micro-batches"
    )
    base = seconds[baseline]
    print("| loop | s/step | tokens/s per rank | model TFLOP/s per rank | throughput vs baseline |")
    print("|---|---|---|---|---|")
    for name, secs in seconds.items():
        print(f"| {name} | {secs:.3f} | {per_rank / secs:.0f} | {flops / secs / 1e12:.4f} | {base / secs:.2f} |")


if __name__ == "__main__":
    main()
