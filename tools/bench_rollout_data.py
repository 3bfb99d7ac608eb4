#!/usr/bin/env python
"""The bytes each rank receives and the host memory it holds for one generation round's data, at the DAPO
paper's round shape, before and after issue 35 (each sample's tokens only to the ranks that train it).

    python tools/bench_rollout_data.py [--world 4] [--scale 0.125] [--moe-scale 0.015625]

Synthetic groups stand in for what the engines return: the paper's round of 1536 prompts (3 x 512) x 16
answers, prompts of 256 tokens, answer lengths log-normal (median 2,000, capped at 20,480 tokens), token ids
below 152,064 (Qwen2.5's vocabulary), one kept group in three (what the 3x round is sized for), so the step
trains on 512 groups. MoE adds each token's routing, 48 layers x top-8 (Qwen3-30B-A3B), as a replaying run
gets it. Each of --world gloo processes is one engine replica (engine TP 1) and one data-parallel rank
(actor TP 1). Two ways, each in processes of its own (so that each peak is its own):
  before  the previous path: the engine's answers as Python lists, every generated group kept until the step
          is chosen, routing as int16 for every generated sample (asked for on every MoE run); the kept
          groups' tokens all-gathered to every rank as one tensor per replica, padded to the largest share
          (all_gather_padded, on the device in a GPU run);
  after   rollout/exchange.py: int32 / float32 / uint8 tensors from the engine's adapter on, only the kept
          groups kept, each chosen sample's tokens (and routing) sent once, to the rank that trains it, by
          one all-to-all of exact sizes over host memory.
Reported per rank, for a whole round (measured at --scale of it and divided by it: both ways are linear in
the tokens): bytes received, and host memory (peak resident set size of the round minus that before it).
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPTS, ANSWERS, PROMPT_LEN, VOCAB, MAX_LEN, KEEP_EVERY = 1536, 16, 256, 152064, 20480, 3
LAYERS, TOPK, EXPERTS = 48, 8, 128  # Qwen3-30B-A3B
MINI_BATCH = 512


def synthetic_groups(replica: int, n_replicas: int, scale: float, moe: bool, as_lists: bool, kept_only: bool):
    """This replica's share of the round, scored: (groups, keep flags), as the engine's adapter hands them on
    (lists before, tensors after) and as the sampler holds them (every group before, the kept ones after)."""
    import torch

    from dapo_mcore.data.types import Group, Prompt, Sample

    g = torch.Generator().manual_seed(1234 + replica)
    groups, keep = [], []
    for i in range(replica, round(PROMPTS * scale), n_replicas):
        kept = i % KEEP_EVERY == 0
        prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=g, dtype=torch.int32)
        lengths = torch.empty(ANSWERS).log_normal_(mean=7.6, std=0.8, generator=g).clamp(1, MAX_LEN).long().tolist()
        if kept_only and not kept:
            continue
        samples = []
        for j, n in enumerate(lengths):
            tokens = torch.randint(0, VOCAB, (n,), generator=g, dtype=torch.int32)
            logprobs = -torch.rand(n, generator=g)
            routed = None
            if moe:  # [prompt + response - 1, layers, k]
                dtype = torch.int16 if as_lists else torch.uint8  # made in its dtype: no int64 temporary
                routed = torch.randint(0, EXPERTS, (PROMPT_LEN + n - 1, LAYERS, TOPK), generator=g, dtype=dtype)
            samples.append(
                Sample(
                    prompt_ids=prompt.tolist() if as_lists else prompt,
                    response_ids=tokens.tolist() if as_lists else tokens,
                    rollout_logprobs=logprobs.tolist() if as_lists else logprobs,
                    finish_reason="length" if n == MAX_LEN else "stop",
                    correct=bool(j % 2),
                    reward=1.0 if j % 2 else -1.0,
                    routed_experts=routed,
                )
            )
        groups.append(Group(Prompt(f"problem {i}", "42", str(i)), samples))
        keep.append(kept)
    return groups, keep


def before_way(groups, keep, replica, n_replicas, scale, moe):
    """The previous path; returns (bytes received, what this rank holds)."""
    import torch
    import torch.distributed as dist

    from dapo_mcore.parallel import all_gather_objects

    sizes = all_gather_objects(sum(_words_int16(g) for g, k in zip(groups, keep) if k))
    payload = torch.cat([_pack_int16(g) for g, k in zip(groups, keep) if k] or [torch.zeros(0, dtype=torch.int32)])
    padded = torch.zeros(max(sizes), dtype=torch.int32)  # every replica's share padded to the largest
    padded[: payload.numel()] = payload
    received = [torch.empty_like(padded) for _ in range(n_replicas)]
    dist.all_gather(received, padded)
    return sum(t.numel() * 4 for t in received), (groups, received)


def _words_int16(group) -> int:
    routing = sum(s.routed_experts.numel() for s in group.samples if s.routed_experts is not None)
    return len(group.samples[0].prompt_ids) + sum(2 * len(s.response_ids) for s in group.samples) + -(-routing // 2)


def _pack_int16(group):
    """A group as the previous exchange laid it out: prompt and responses, log-probs, int16 routing in words."""
    import torch

    parts = [torch.as_tensor(group.samples[0].prompt_ids, dtype=torch.int32)]
    parts += [torch.as_tensor(s.response_ids, dtype=torch.int32) for s in group.samples]
    parts += [torch.as_tensor(s.rollout_logprobs, dtype=torch.float32).view(torch.int32) for s in group.samples]
    routing = [s.routed_experts.reshape(-1) for s in group.samples if s.routed_experts is not None]
    if routing:
        values = torch.cat(routing)
        parts.append(torch.cat([values, values.new_zeros(values.numel() % 2)]).view(torch.int32))
    return torch.cat(parts)


def after_way(groups, keep, replica, n_replicas, scale, moe):
    """rollout/exchange.py as the sampler calls it; returns (bytes received, what this rank holds)."""
    import torch.distributed as dist

    from dapo_mcore.data.batching import DataParallelSplit
    from dapo_mcore.parallel import all_gather_objects, all_to_all_on_host
    from dapo_mcore.rollout.exchange import ExchangeRanks, fetch_groups, summarize

    keys = [(0, i) for i in range(len(groups))]
    summaries = [summarize(g, True, replica, key) for g, key in zip(groups, keys)]
    every = [s for share in all_gather_objects(summaries) for s in share]
    chosen = every[: round(PROMPTS * scale / KEEP_EVERY)]
    lengths = [g.prompt_len + s.response_len for g in chosen for s in g.samples]
    split = DataParallelSplit(n_replicas, micro_batch_size=4, max_tokens_per_micro_batch=0, packed=False, multiple=8)
    flat = iter(split.trainers(lengths, max(1, round(MINI_BATCH * scale))))
    trainers = [[next(flat) for _ in g.samples] for g in chosen]
    received = []

    def transport(send, send_sizes, recv_sizes):
        received.append(sum(recv_sizes) * 4)
        return all_to_all_on_host(send, send_sizes, recv_sizes, group=dist.group.WORLD)

    ranks = ExchangeRanks(replica, 1, tuple(range(n_replicas)))
    batch = fetch_groups(chosen, trainers, dict(zip(keys, groups)), ranks, transport)
    return sum(received), (groups, batch)


def worker(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    before = args.way == "before"
    rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    dist.barrier()
    start = time.perf_counter()
    groups, keep = synthetic_groups(rank, world, args.scale, args.moe, as_lists=before, kept_only=not before)
    received, held = (before_way if before else after_way)(groups, keep, rank, world, args.scale, args.moe)
    dist.barrier()
    seconds = time.perf_counter() - start
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_start) * 1024  # KiB on Linux
    results = [None] * world
    dist.all_gather_object(results, {"received": received, "host": peak, "seconds": seconds})
    if rank == 0:
        print(json.dumps(results))
    del held
    dist.destroy_process_group()


def launch(args, way: str, moe: bool, scale: float) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.world), "--master_port",
           "29517", __file__, "--worker", "--way", way, "--scale", str(scale)] + (["--moe"] if moe else [])  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--scale", type=float, default=0.125, help="share of the dense round measured")
    parser.add_argument("--moe-scale", type=float, default=1 / 64, help="share of the MoE round measured")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--way", choices=["before", "after"], help=argparse.SUPPRESS)
    parser.add_argument("--moe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, world {args.world} (gloo, engine "
          f"TP 1, actor DP {args.world}); per rank, for a whole round\n")  # fmt: skip
    print("| data | way | received per rank | host memory per rank (peak) | time (s) |")
    print("|---|---|---|---|---|")
    for moe, scale in ((False, args.scale), (True, args.moe_scale)):
        rows = {}
        for way in ("before", "after"):
            per_rank = launch(args, way, moe, scale)
            received = max(r["received"] for r in per_rank) / scale
            host = max(r["host"] for r in per_rank) / scale
            rows[way] = (received, host)
            seconds = max(r["seconds"] for r in per_rank) / scale
            label = f"{'MoE + routing' if moe else 'dense'} (measured at {scale:g})"
            print(f"| {label} | {way} | {received / 2**30:.2f} GiB | {host / 2**30:.2f} GiB | {seconds:.1f} |")
        (rb, hb), (ra, ha) = rows["before"], rows["after"]
        print(f"| | after / before | {ra / rb:.3f} | {ha / hb:.3f} | |")


if __name__ == "__main__":
    main()
